/*
 * gdn_cuda_common.cuh — what the CUDA forward, backward and recurrent files
 * share: the error-check macro, dtype load/store helpers, the bf16 tensor-core
 * wrappers (mma.sync m16n8k16 + ldmatrix + cp.async, all sm_80 PTX so the
 * compute_80 fallback build runs the same code), the varlen chunk table, and
 * the forward stage launchers with their workspace layout (the backward calls
 * them to recompute W, U, the chunk-start states h and Vn).
 *
 * Forward (DESIGN §2, C = 64), one launcher per stage, in algorithm order:
 *
 *   fq_cuda_fwd_prepare  chunk table from cu_seqlens (device memory, no host
 *                        sync; invalid contents set ws->flags[0]), bf16 copies
 *                        of q/k/v when dtype != bf16, inverse L2 norms of q/k
 *   fq_cuda_fwd_wy       stage A, per (chunk, value head):
 *                          gamma = cumsum(g); L = strict_lower(diag(beta)(K K^T ⊙ Gamma))
 *                          A = (I + L)^-1;  W = A diag(beta e^gamma) K;  U = A diag(beta) V
 *   fq_cuda_fwd_state    stage B, per (sequence, value head, BV state columns):
 *                          h_c = S;  Vn = U - W S;  S = e^{gamma_C} S + K^T diag(e^{gamma_C - gamma}) Vn
 *   fq_cuda_fwd_output   stage C, per (chunk, value head):
 *                          O = scale (diag(e^gamma) Q S + lower_incl(Q K^T ⊙ Gamma) Vn)
 *   fq_cuda_fwd_poison   o, ht, checkpoints <- NaN when ws->flags[0] says cu_seqlens was invalid
 *
 * With use_qk_l2norm the normalisation is never materialised: q = rq * q_raw,
 * k = rk * k_raw with per-token scalars rq, rk (ws->rq, ws->rk) folded into the
 * per-row factors of each stage.
 *
 * Include only from .cu files (C++17, nvcc).
 */
#ifndef FQ_GDN_CUDA_COMMON_CUH
#define FQ_GDN_CUDA_COMMON_CUH

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "gdn.h"

#include <string.h>

/* ------------------------------------------------------------ errors ---- */

/* The one error check: a failed CUDA call returns FQ_ERR_CUDA with the CUDA
 * error text (never exits). Use inside functions returning fq_status. */
#define FQ_CUDA_CHECK(call)                                                       \
    do {                                                                          \
        cudaError_t fq_cuda_e_ = (call);                                          \
        if (fq_cuda_e_ != cudaSuccess)                                            \
            return fq_fail(FQ_ERR_CUDA, "%s:%d: %s", __FILE__, __LINE__,          \
                           cudaGetErrorString(fq_cuda_e_));                       \
    } while (0)
/* After every kernel launch. */
#define FQ_CUDA_CHECK_LAUNCH() FQ_CUDA_CHECK(cudaGetLastError())

/* FQ_OK when the caller's workspace holds at least `need` bytes, else a
 * failure that says how many it needs. */
static inline fq_status fq_cuda_check_workspace(const fq_gdn_params *p, size_t need)
{
    if (!p->workspace || p->workspace_bytes < need)
        return fq_fail(FQ_ERR_VALUE, "workspace: expected at least %zu bytes, got %zu", need,
                       p->workspace ? p->workspace_bytes : (size_t)0);
    return FQ_OK;
}

/* The stage launchers' fallthrough after their K, V template dispatch. The
 * entry points refuse other head dims first (fq_cuda_fwd_check_sizes), so
 * this is only reached by a caller that skipped that check. */
static inline fq_status fq_cuda_head_dims_unsupported(const fq_gdn_params *p)
{
    return fq_fail(FQ_ERR_VALUE, "k, v: this CUDA kernel supports K, V in {64, 128}, got K=%lld V=%lld",
                   (long long)p->K, (long long)p->V);
}

#define FQ_CHUNK 64 /* chunk size C */

/* The H100 / H200 opt-in shared memory per block (227 KB): the budget the
 * chunk kernels at K = V = 256 are laid out for (the forward's stage B ring
 * depth, stage C's 199 KB; the backward's 172-199 KB); fq_cuda_check_k256_smem
 * refuses K = 256 on a GPU that offers less. */
#define FQ_SMEM_OPTIN_H100 (227 * 1024)

typedef __nv_bfloat16 fq_bf16;

/* ------------------------------------------------ dtype load / store ---- */

/* Element i of an array of dtype dt, as float (dt is uniform across a warp, so
 * the switch costs no divergence). */
static __device__ __forceinline__ float fq_ld_f(const void *p, fq_dtype dt, int64_t i)
{
    switch (dt) {
    case FQ_F32: return ((const float *)p)[i];
    case FQ_F16: return __half2float(((const __half *)p)[i]);
    case FQ_BF16: return __bfloat162float(((const fq_bf16 *)p)[i]);
    default: return (float)((const double *)p)[i];
    }
}

static __device__ __forceinline__ void fq_st_f(void *p, fq_dtype dt, int64_t i, float x)
{
    switch (dt) {
    case FQ_F32: ((float *)p)[i] = x; break;
    case FQ_F16: ((__half *)p)[i] = __float2half_rn(x); break;
    case FQ_BF16: ((fq_bf16 *)p)[i] = __float2bfloat16_rn(x); break;
    default: ((double *)p)[i] = (double)x; break;
    }
}

/* Two consecutive elements i, i+1 (i even, array aligned): one 4/8-byte store. */
static __device__ __forceinline__ void fq_st_f2(void *p, fq_dtype dt, int64_t i, float x, float y)
{
    switch (dt) {
    case FQ_F32: *(float2 *)((float *)p + i) = make_float2(x, y); break;
    case FQ_F16: *(__half2 *)((__half *)p + i) = __floats2half2_rn(x, y); break;
    case FQ_BF16: *(__nv_bfloat162 *)((fq_bf16 *)p + i) = __floats2bfloat162_rn(x, y); break;
    default: ((double *)p)[i] = (double)x; ((double *)p)[i + 1] = (double)y; break;
    }
}

/* Two floats -> packed bf16x2 (x in the low half, as mma operands expect). */
static __device__ __forceinline__ uint32_t fq_pack_bf16(float x, float y)
{
    __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    return *(uint32_t *)&v;
}

static __device__ __forceinline__ float2 fq_unpack_bf16(uint32_t u)
{
    __nv_bfloat162 v = *(__nv_bfloat162 *)&u;
    return __bfloat1622float2(v);
}

/* ------------------------------------------------------ full resets ---- */

/* issue 9: a gate g <= FQ_GATE_RESET (-100; -inf included) is a full reset
 * (gdn.h). The chunk kernels load every gate through this clamp, so that
 * gamma = cumsum(g) stays finite and no gamma_r - gamma_s is -inf - -inf
 * (NaN): every difference across a reset is then <= -100, and its e^ is 0 in
 * float (e^-100 = 4e-44, flushed to zero by __expf), as is e^gamma after a
 * reset; inside a segment the differences keep their value up to
 * ulp(100 * resets in the chunk) (1.5e-5 per reset, far below the bf16
 * budget). This equals the CPU's exact rule (a cumsum restarted at each reset,
 * gdn_cpu.h fq_cpu_gate_scan) within float. A NaN gate passes through (the
 * comparison is false): NaN stays NaN. */
static __device__ __forceinline__ float fq_gate_clamp(float x)
{
    return x < (float)FQ_GATE_RESET ? (float)FQ_GATE_RESET : x;
}
static __device__ __forceinline__ float fq_gate_load(const void *g, fq_dtype dt, int64_t i)
{
    return fq_gate_clamp(fq_ld_f(g, dt, i));
}

/* --------------------------------------------- tensor cores (sm_80) ---- */

static __device__ __forceinline__ uint32_t fq_smem_u32(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* d += a * b, m16n8k16, bf16 inputs, fp32 accumulators. Fragments (PTX ISA):
 * g = lane / 4, t = lane % 4;
 *   a[0] = A[g][2t..2t+1]  a[1] = A[g+8][2t..]  a[2] = A[g][2t+8..]  a[3] = A[g+8][2t+8..]
 *   b[0] = B[2t..2t+1][g]  b[1] = B[2t+8..][g]
 *   d[0..1] = D[g][2t..2t+1]  d[2..3] = D[g+8][2t..2t+1]                      */
static __device__ __forceinline__ void fq_mma_bf16(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

static __device__ __forceinline__ void fq_ldsm_x4(uint32_t r[4], uint32_t addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

static __device__ __forceinline__ void fq_ldsm_x4_trans(uint32_t r[4], uint32_t addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

/* Fragment loads from bf16 shared-memory tiles with row stride ld (elements,
 * ld * 2 a multiple of 16 bytes; pad rows by 8 elements against bank
 * conflicts). All 32 lanes call them. */

/* A (16x16 at m0, k0) of a tile stored [m][k]. */
static __device__ __forceinline__ void fq_frag_a(uint32_t a[4], const fq_bf16 *s, int ld, int m0, int k0)
{
    int l = threadIdx.x & 31;
    int row = m0 + (l & 7) + ((l >> 3) & 1) * 8, col = k0 + (l >> 4) * 8;
    fq_ldsm_x4(a, fq_smem_u32(s + row * ld + col));
}

/* A (16x16 at m0, k0) of a tile stored transposed, [k][m]. */
static __device__ __forceinline__ void fq_frag_a_trans(uint32_t a[4], const fq_bf16 *s, int ld, int m0, int k0)
{
    int l = threadIdx.x & 31, mi = l >> 3;
    int row = k0 + (l & 7) + (mi >> 1) * 8, col = m0 + (mi & 1) * 8;
    fq_ldsm_x4_trans(a, fq_smem_u32(s + row * ld + col));
}

/* B for two n8 tiles (k0..k0+15, n0..n0+15) of a tile stored [n][k]:
 * b[0], b[1] for columns n0..n0+7, b[2], b[3] for n0+8..n0+15. */
static __device__ __forceinline__ void fq_frag_b_nk(uint32_t b[4], const fq_bf16 *s, int ld, int n0, int k0)
{
    int l = threadIdx.x & 31;
    int row = n0 + (l & 7) + (l >> 4) * 8, col = k0 + ((l >> 3) & 1) * 8;
    fq_ldsm_x4(b, fq_smem_u32(s + row * ld + col));
}

/* The same from a tile stored [k][n]. */
static __device__ __forceinline__ void fq_frag_b_kn(uint32_t b[4], const fq_bf16 *s, int ld, int k0, int n0)
{
    int l = threadIdx.x & 31;
    int row = k0 + (l & 7) + ((l >> 3) & 1) * 8, col = n0 + (l >> 4) * 8;
    fq_ldsm_x4_trans(b, fq_smem_u32(s + row * ld + col));
}

/* 16-byte asynchronous copy global -> shared; src_bytes = 0 zero-fills (the
 * source address must still be a valid pointer). */
static __device__ __forceinline__ void fq_cp_async16(void *dst, const void *src, int src_bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(fq_smem_u32(dst)), "l"(src), "r"(src_bytes));
}
/* 8 bytes (both addresses 8-byte aligned), through L1 (.cg takes 16 only) */
static __device__ __forceinline__ void fq_cp_async8(void *dst, const void *src)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" :: "r"(fq_smem_u32(dst)), "l"(src));
}
static __device__ __forceinline__ void fq_cp_async_commit(void)
{
    asm volatile("cp.async.commit_group;\n" ::);
}
template <int N> static __device__ __forceinline__ void fq_cp_async_wait(void)
{
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N));
}

/* bar.sync on named barrier id (1..15; 0 is __syncthreads) among nthreads (a multiple of 32). */
static __device__ __forceinline__ void fq_named_bar(int id, int nthreads)
{
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(nthreads) : "memory");
}

/* Inclusive prefix sum of x over the thread block (blockDim.x a multiple of
 * 32, at most 1024): a warp scan, then warp 0 scans the warp totals in
 * s_warp (32 ints of shared memory). Every thread of the block calls it; it
 * reads s_warp after its last barrier, so the caller syncs the block before
 * calling it again. */
static __device__ __forceinline__ int fq_block_inclusive_scan(int x, int *s_warp)
{
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) s_warp[wid] = x;
    __syncthreads();
    if (wid == 0) {
        int wv = lane < nw ? s_warp[lane] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            int y = __shfl_up_sync(0xffffffffu, wv, o);
            if (lane >= o) wv += y;
        }
        s_warp[lane] = wv; /* inclusive over warps */
    }
    __syncthreads();
    return x + (wid > 0 ? s_warp[wid - 1] : 0);
}

/* ----------------------------------------------------- chunk table ---- */

/* One entry per chunk (grid bound nc_max; entries past the real count have
 * seq = -1 and blocks for them exit). Rows are global token rows: the element
 * (row, head) of q is q[(row * H + head) * K + i] for both layouts. */
typedef struct fq_chunk_info {
    int seq;    /* sequence n, or -1: no chunk here                          */
    int row0;   /* global row of the chunk's first token                     */
    int len;    /* tokens in the chunk, 1..64                                */
    int local;  /* chunk number inside its sequence                          */
} fq_chunk_info;

typedef struct fq_seq_info {
    int bos;     /* global row of the first token                            */
    int len;     /* tokens                                                   */
    int chunk0;  /* global index of its first chunk                          */
    int nchunks; /* ceil(len / 64); 0 for an empty sequence                  */
} fq_seq_info;

/* 1 when one of the 8 bf16 in x is an Inf or NaN (exponent bits all ones). */
static __device__ __forceinline__ int fq_bf16x8_nonfinite(uint4 x)
{
    const uint32_t m = 0x7f807f80u;
    const uint32_t w[4] = {x.x, x.y, x.z, x.w};
    int bad = 0;
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const uint32_t y = w[e] & m;
        bad |= (y & 0xffffu) == 0x7f80u || (y >> 16) == 0x7f80u;
    }
    return bad;
}

/* Entry i of an int32 (is64 = 0) or int64 index array: cu_seqlens,
 * state_indices. */
static __device__ __forceinline__ int64_t fq_ld_index(const void *p, int is64, int64_t i)
{
    return is64 ? ((const int64_t *)p)[i] : (int64_t)((const int32_t *)p)[i];
}

/* [serving: state layout] Offset of element (k, v) in a K x V state stored
 * [K][V] (vk = 0) or [V][K] (vk = 1: FLA's state_v_first, the vLLM /
 * FlashInfer pools). */
static __device__ __forceinline__ int64_t fq_state_at(int k, int v, int K, int V, int vk)
{
    return vk ? (int64_t)v * K + k : (int64_t)k * V + v;
}

/* The fused forward's unit of work: a segment of a sequence's chunks (the
 * whole sequence unless context parallelism splits it; gdn_cuda_fwd_fused.cu). */
typedef struct fq_seg_info {
    int seq;     /* sequence n, or -1: no segment here                        */
    int bos;     /* global row of the segment's first token                   */
    int len;     /* tokens in the segment                                     */
    int chunk0;  /* global index of its first chunk                           */
    int nchunks; /* chunks in the segment                                     */
    int index;   /* its place in the sequence, 0 .. count - 1                 */
    int count;   /* segments of the sequence                                  */
    int cp;      /* its slot in the maps and start states (ws->md, ws->ss): its
                    place among the segments of split sequences (count > 1),
                    consecutive within a sequence; -1 when count == 1        */
    int cfirst;  /* chunks of its sequence before the segment                 */
    int slot;    /* the sequence's state slot in h0 / ht (n; with a pool its index
                    state_indices[n]), FQ_SLOT_NONE (start from zeros, write
                    nothing back) or FQ_SLOT_DUP (a slot an earlier sequence
                    names: start from NaN, write nothing back; gdn.h)         */
} fq_seg_info;
#define FQ_SLOT_NONE (-1)
#define FQ_SLOT_DUP (-2)

/* The fused forward's segment maps and start states in o (ws->md NULL): o's rows
 * of a split sequence hold them from the MAP pass until the FULL pass writes
 * o over them, so that they take no workspace. Per (sequence, value head j),
 * the sequence's tokens t, each a row of RB = V elem bytes at
 * o + (t HV + j) RB, F = RB / 4 floats:
 *   the start state of segment s (K x V fp32) in the first rss = 4 K / elem
 *     rows of the segment, by column block: element (kd, 64 vb + c) at float
 *     e % F' of row e / F' of o's columns 64 vb .., e = 64 kd + c, F' = 16 elem,
 *     so that the FULL CTA (s, j, vb) finds its start state where only it
 *     writes o, and reads it before it writes;
 *   the maps [M | D] of segments 0 .. P - 2 (K x (K + V) fp32 each) by blocks
 *     of 64 columns (K x 64, element (kd, c) at float 64 kd + c: rblk = 64 K / F
 *     rows), block B = ncb sg + cb (ncb = (K + V) / 64) in order over the
 *     segments' other rows: cap = (64 L - rss) / rblk blocks after the start
 *     state of each segment of L chunks, the rest after the last segment's.
 * fq_fwd_segments_kernel splits a sequence only as far as both fit (cp_fit). */
typedef struct fq_omap {
    char *o;  /* o's base (16-byte aligned)                                 */
    int HV;
    int rb;   /* bytes of one head's row: V elem                             */
    int lf;   /* log2 F, the floats of a row                                 */
    int lfs;  /* log2 F', the floats of 64 columns of a row (16 elem)        */
    int sb;   /* bytes of 64 columns of a row (64 elem)                      */
    int rss;  /* rows of one start state (4 K / elem)                        */
    int rblk; /* rows of one map block (64 K / F)                            */
    int ncb;  /* map blocks per map, (K + V) / 64                            */
} fq_omap;

/* The layout for an o of dtype odt (fp32: 4-byte elements, else 2). */
static __host__ __device__ __forceinline__ fq_omap fq_omap_make(void *o, int HV, int K, int V, fq_dtype odt)
{
    fq_omap m;
    const int elem = odt == FQ_F32 ? 4 : 2;
    m.o = (char *)o;
    m.HV = HV;
    m.rb = V * elem;
    m.lf = m.rb / 4 == 128 ? 7 : m.rb / 4 == 64 ? 6 : 5; /* (V in {64, 128}) */
    m.lfs = elem == 4 ? 6 : 5;
    m.sb = 64 * elem;
    m.rss = 4 * K / elem;
    m.rblk = (64 * K) >> m.lf;
    m.ncb = (K + V) / 64;
    return m;
}
static inline fq_omap fq_omap_of(const fq_gdn_params *p)
{
    return fq_omap_make(p->o, (int)p->HV, (int)p->K, (int)p->V, p->dtype);
}

/* element (kd, 64 vb + c) of the start state of the segment whose first token is bos */
static __device__ __forceinline__ float *fq_omap_ss(const fq_omap &m, int64_t bos, int j, int vb, int kd, int c)
{
    const int e = 64 * kd + c;
    return (float *)(m.o + ((bos + (e >> m.lfs)) * m.HV + j) * (int64_t)m.rb + (int64_t)vb * m.sb) +
           (e & ((1 << m.lfs) - 1));
}

/* the first row of map block B of a sequence whose first token is bos0, split
 * in P segments of L chunks (the last fewer) */
static __device__ __forceinline__ int64_t fq_omap_blk(const fq_omap &m, int64_t bos0, int L, int P, int B)
{
    const int cap = (64 * L - m.rss) / m.rblk;
    int s = B / cap;
    if (s > P - 1) s = P - 1;
    return bos0 + (int64_t)s * 64 * L + m.rss + (int64_t)(B - s * cap) * m.rblk;
}

/* element (kd, c) (c < 64) of the map block whose first row is R */
static __device__ __forceinline__ float *fq_omap_at(const fq_omap &m, int64_t R, int j, int kd, int c)
{
    const int e = 64 * kd + c;
    return (float *)(m.o + ((R + (e >> m.lf)) * m.HV + j) * (int64_t)m.rb) + (e & ((1 << m.lf) - 1));
}

/* A'' = A diag(beta) of one (chunk, value head) as the fused forward stores
 * and reads it (stage A -> the main kernel's Vn^T = Y^T A''^T, where A''^T is
 * wgmma's K-major B operand: K = the column c of A'', N = its row r). In
 * shared memory the dense tile without swizzle: K-step kk (columns 16 kk..)
 * at 2048 kk bytes, as 8 x 8 core matrices (8 rows r of 16 bytes, 128 bytes
 * contiguous), core (row group nb = r / 8, half h = (c / 8) % 2) at
 * (2 nb + h) 128 bytes (LBO = 128, SBO = 256). In global memory only what
 * is not structurally zero: K-step kk's rows r >= 16 kk (the blocks above
 * the diagonal are left out), which are the last 2048 - 512 kk bytes of its
 * shared-memory region, K-steps back to back from fq_apack_step_bytes(kk)
 * = 256 (8 kk - kk (kk - 1)) (0, 2048, 3584, 4608): 5120 bytes per tile,
 * 62.5 % of the dense one; one bulk copy per K-step puts them in place. */
#define FQ_APACK_BYTES 5120
#define FQ_APACK_ELEMS (FQ_APACK_BYTES / 2)
static __host__ __device__ __forceinline__ int fq_apack_step_bytes(int kk) { return 256 * (8 * kk - kk * (kk - 1)); }
/* element index of A''[r][c] in the packed tile; -1 for a block above the diagonal (r < 16 (c / 16)) */
static __host__ __device__ __forceinline__ int fq_apack_index(int r, int c)
{
    const int kk = c >> 4;
    if (r < 16 * kk) return -1;
    return (fq_apack_step_bytes(kk) + (((r >> 3) - 2 * kk) * 2 + ((c >> 3) & 1)) * 128 + (r & 7) * 16) / 2 + (c & 7);
}

/* The gate record of one (chunk, value head), written by the fused
 * forward's stage A for its main kernel (which reads it by one bulk copy):
 * per row r, vectors of 64 floats at these offsets, then e^{gamma_C}. */
#define FQ_REC_G2 0     /* gamma_r log2(e)                                     */
#define FQ_REC_RK 64    /* rk_r (inverse key norm; 1 without l2norm, 0 padding) */
#define FQ_REC_PRQ 128  /* scale rq_r                                          */
#define FQ_REC_FA1 192  /* e^gamma_r rk_r: the columns of A' = A'' diag(.)     */
#define FQ_REC_QG 256   /* scale e^gamma_r rq_r: the rows of Q S               */
#define FQ_REC_KD 320   /* e^{gamma_C - gamma_r} rk_r: the rows of K in S's update */
#define FQ_REC_BETA 384 /* beta_r                                              */
#define FQ_REC_EC 448   /* e^{gamma_C} (NaN when a row is poisoned, below)      */
#define FQ_REC_F 449    /* f: the chunk's first row with a non-finite k, g or beta
                           (64: none; issue 9, causality), then 2 floats of padding */
#define FQ_REC_FLOATS 452 /* 1808 bytes, a multiple of 16                      */

/* ------------------------------------------- forward workspace layout ---- */

/* Pointers into the caller's workspace (each region 256-byte aligned).
 * Per-chunk arrays are indexed by the global chunk index c < nc_max and the
 * value head j; padding rows (row >= len in the last chunk of a sequence) are
 * written as zeros (w, u, vn, kdecay) and gamma[r] = gamma[len-1] there. */
typedef struct fq_fwd_ws {
    int64_t nc_max;          /* ceil(T/64) + N when B == 1, else B*ceil(T/64)  */
    fq_chunk_info *chunks;   /* [nc_max]                                      */
    fq_seq_info *seqs;       /* [N]                                           */
    int *flags;              /* [0]: cu_seqlens invalid, [1]: real chunk count */
    float *rq, *rk;          /* [B*T, H] inverse L2 norms; NULL without l2norm */
    const fq_bf16 *qb, *kb, *vb; /* bf16 q, k, v: the inputs when dtype == bf16,
                                    else copies in the workspace          */
    float *gamma;            /* [nc_max, HV, 64] chunk-local cumsum of g       */
    float *kdecay;           /* [nc_max, HV, 64] e^{gamma_C - gamma_r} * rk_r   */
    fq_bf16 *w;              /* [nc_max, HV, 64, K]  W = A diag(beta e^gamma) k */
    fq_bf16 *u;              /* [nc_max, HV, 64, V]  U = A diag(beta) v        */
    fq_bf16 *h;              /* [nc_max, HV, K, V]   chunk-start states         */
    fq_bf16 *vn;             /* [nc_max, HV, 64, V]  Vn = U - W h              */
    fq_bf16 *a;              /* [nc_max, HV, 64, 64] A = (I+L)^-1, written by
                                fq_cuda_fwd_wy only when non-NULL; the forward
                                leaves it NULL (for the backward's use);
                                the fused forward's stage A writes A'' there,
                                packed: [nc_max, HV, FQ_APACK_ELEMS]       */
    float *rec;              /* fused forward: [nc_max, HV, FQ_REC_FLOATS] the
                                gate record (NULL otherwise)               */
    /* fused forward, its segments (context parallelism):                    */
    int nseg_max;            /* segments per sequence at most (1: none)       */
    int64_t seg_bound;       /* segment slots (from sizes only)               */
    fq_seg_info *segs;       /* [seg_bound]                                   */
    int64_t cp_bound;        /* slots of md and ss: min(seg_bound, nc_max / FQ_CP_MIN_CHUNKS),
                                the segments of split sequences at most (each has
                                >= FQ_CP_MIN_CHUNKS chunks); from sizes only    */
    float *md;               /* [cp_bound, HV, K, K + V] segment maps [M | D], by
                                fq_seg_info.cp; NULL when nseg_max == 1, and in
                                the forward, whose maps and start states live
                                in o's rows instead (fq_omap above)          */
    float *ss;               /* [cp_bound, HV, K, V] segment start states, by
                                fq_seg_info.cp (NULL where md is)            */
    int cp_fit;              /* 1: a sequence splits only as far as its maps fit
                                in its rows of o (fq_fwd_segments_kernel; the
                                forward and the backward's recompute)        */
    int *ready;              /* fused forward: [nc_max, HV] stage A's flags, set
                                per (chunk, value head) when its A'' and record
                                are written (read only when stage A runs beside
                                the state pass: fq_cuda_fwd_beside)          */
    /* the backward's fused recompute (NULL elsewhere): stage A (fq_cuda_fwd_inverse)
     * also writes the backward's A and, per (chunk, value head), 1 where the
     * item holds a non-finite input (fq_cuda_fwd_wy_given then forms its A again) */
    fq_bf16 *abwd;           /* [nc_max, HV, 64, 64]                           */
    int *aflag;              /* [nc_max, HV]                                   */
} fq_fwd_ws;

#ifdef __cplusplus
extern "C" {
#endif

/* Lays the forward workspace out from `base` (NULL: sizes only) and returns
 * its size in bytes (a multiple of 256). ws->a is set to NULL. Depends only
 * on the sizes and dtype of p. */
size_t fq_cuda_fwd_ws_layout(const fq_gdn_params *p, void *base, fq_fwd_ws *ws);
/* The same without the regions of omit (ws->w, ws->u NULL): the backward on
 * bwd_rev90's path, which never forms W, and with the fused recompute's stage A
 * (given A) no U either. */
#define FQ_FWS_OMIT_W 1
#define FQ_FWS_OMIT_U 2
size_t fq_cuda_fwd_ws_layout_omit(const fq_gdn_params *p, void *base, fq_fwd_ws *ws, int omit);

/* The fused sm_90a forward's workspace (gdn_cuda_fwd_fused.cu): the chunk
 * table, norms and bf16 copies as above, then a and rec; gamma, kdecay, w,
 * u, h, vn are NULL. Returns its size (a multiple of 256). */
size_t fq_cuda_fwd_fused_ws_layout(const fq_gdn_params *p, void *base, fq_fwd_ws *ws);
/* Only the fused forward's own part of that workspace (a, rec, the segment
 * table, maps and start states, ready), laid out from `base` (NULL: sizes
 * only); the other fields of ws are left as they are (the backward's
 * recompute: the chunk table, norms and bf16 copies of its three-stage
 * workspace). Returns its size (a multiple of 256). */
size_t fq_cuda_fwd_fused_extras_layout(const fq_gdn_params *p, void *base, fq_fwd_ws *ws);
/* Context parallelism of the fused forward (exact, DESIGN §2): a sequence
 * of nc chunks is split into min(nseg_max, nc / FQ_CP_MIN_CHUNKS) segments
 * (none where that is below three; with cp_fit fewer, until the maps fit in
 * the sequence's rows of o: fq_omap) of equal chunk counts (the last may be
 * shorter); nseg_max depends on the head shape (HV, K, V) only, so a
 * sequence's split depends on its own length, the head shape and o's dtype,
 * never on the other sequences of the batch or on data. FQ_CP_SMS: the SM
 * count the split is planned for (a constant, not the device's: the same bits
 * on every device). */
#ifndef FQ_CP_MIN_CHUNKS /* (a -D of a dev build may try another: dev/cuda/run_ab.sh) */
#define FQ_CP_MIN_CHUNKS 8
#endif
#define FQ_CP_SMS 132
/* The split itself, for a sequence of nch chunks and nseg segments asked (after the
 * limits above): fewer than three -> one; *len = chunks per segment (the last may have
 * fewer); returns the segments' count (an empty sequence: one). fq_fwd_segments_kernel
 * and, for its order, the backward's bwd_wy beside the chains (gdn_cuda_bwd.cu). */
static __host__ __device__ __forceinline__ int fq_cp_split(int nch, int nseg, int *len)
{
    if (nseg < 3) nseg = 1; /* (two would gain nothing) */
    int L = (nch + nseg - 1) / nseg;
    if (L < 1) L = 1;
    *len = L;
    return nch > 0 ? (nch + L - 1) / L : 1;
}
int fq_cuda_fwd_nseg_max(const fq_gdn_params *p);
/* Segment slots for nc_max chunk slots: N nseg_max, or fewer where the
 * chunks cannot fill them (N + nc / FQ_CP_MIN_CHUNKS); from sizes only. */
int64_t fq_cuda_fwd_seg_bound(const fq_gdn_params *p, int64_t nc, int nseg_max);
/* Slots of the maps and start states: the segments of split sequences at most. */
int64_t fq_cuda_fwd_cp_bound(const fq_gdn_params *p, int64_t nc, int nseg_max);
/* 1 when the fused forward runs for p on the current device: an sm_90 GPU
 * running this module's sm_90a code, K and V in {64, 128} (never K = 256:
 * the three-stage forward runs it). */
int fq_cuda_fwd_fused_available(const fq_gdn_params *p);
/* Stage A beside the state pass: when the fused forward's FULL pass has at
 * most half as many CTAs as the device has SMs (no context parallelism, few
 * chains: one or two long sequences) and programmatic dependent launch is
 * on, stage A runs at once with it on the SMs it leaves free, and the state
 * pass waits per chunk for stage A's flag (ws->ready) instead of for the
 * whole of stage A. Returns the number of stage A blocks for that (one per
 * free SM, 4 workers each), or 0: the kernels run one after the other. */
int fq_cuda_fwd_beside(const fq_gdn_params *p, const fq_fwd_ws *ws);
/* Stage A of the fused forward: gamma, A = (I+L)^-1 (as A diag(beta), bf16,
 * into ws->a) and the gate record ws->rec per (chunk, value head). beside:
 * fq_cuda_fwd_beside's block count (0: as a kernel of its own); then it sets
 * ws->ready per item and lets the state pass launch once all its blocks run. */
fq_status fq_cuda_fwd_inverse(const fq_gdn_params *p, const fq_fwd_ws *ws, int beside, cudaStream_t stream);
/* fq_cuda_fwd_inverse and fq_cuda_fwd_segments in the order the state pass
 * wants (beside: the table first, stage A beside the pass; *beside = 1). */
fq_status fq_cuda_fwd_stage_a(const fq_gdn_params *p, const fq_fwd_ws *ws, int *beside, cudaStream_t stream);
/* The segment table (and, beside, ws->ready cleared): the first kernel of
 * the fused forward's passes, before stage A when it runs beside them. */
fq_status fq_cuda_fwd_segments(const fq_gdn_params *p, const fq_fwd_ws *ws, int beside, cudaStream_t stream);
/* The fused state pass and outputs: o and, if non-NULL, ht (after
 * fq_cuda_fwd_segments). beside: stage A runs beside it (poll ws->ready). */
fq_status fq_cuda_fwd_fused(const fq_gdn_params *p, const fq_fwd_ws *ws, int beside, cudaStream_t stream);
/* The backward's recompute on the fused kernel (its MAP pass and combine as
 * above, then the state pass in mode HST): no o, no ht; each chunk's start
 * state to h [nc_max, HV, K, V] and Vn to vn [nc_max, HV, 64, V] (bf16, the
 * three-stage state pass's layouts, Vn rows past a chunk's length 0). ws:
 * the fused workspace (fq_cuda_fwd_fused_extras_layout), after
 * fq_cuda_fwd_segments and stage A. */
fq_status fq_cuda_fwd_fused_states(const fq_gdn_params *p, const fq_fwd_ws *ws, int beside, fq_bf16 *h, fq_bf16 *vn,
                                   cudaStream_t stream);

/* FQ_OK unless K = 256 and the current device offers less than
 * FQ_SMEM_OPTIN_H100 of shared memory per block (a ValueError naming k). */
fq_status fq_cuda_check_k256_smem(const fq_gdn_params *p);

/* Shape/dtype rules of the CUDA chunk kernels (K, V in {64, 128}, or K = V
 * = 256; dtype not F64). Returns FQ_OK or a failure with the message set. */
fq_status fq_cuda_fwd_check_sizes(const fq_gdn_params *p);

/* The stages; each launches on `stream` (device already set), checks its
 * launches, never synchronises. */
fq_status fq_cuda_fwd_prepare(const fq_gdn_params *p, const fq_fwd_ws *ws, cudaStream_t stream);
fq_status fq_cuda_fwd_wy(const fq_gdn_params *p, const fq_fwd_ws *ws, cudaStream_t stream);
/* Stage A as the backward's recompute runs it (the persistent kernel; see gdn_cuda_fwd_wy.cu).
 * with_u = 0: ws->u is not written (the fused recompute's chain forms Vn without U). */
fq_status fq_cuda_fwd_wy_recompute(const fq_gdn_params *p, const fq_fwd_ws *ws, int with_u, cudaStream_t stream);
/* The fused recompute's, after its stage A (fq_cuda_fwd_inverse with ws->abwd = ws->a,
 * ws->aflag set) wrote A, gamma, kdecay of every item and listed the items holding a
 * non-finite input: those items' A, gamma, kdecay again by the backward's rules, and their
 * flag (W's NaN rows; no W is formed; gdn_cuda_fwd_wy.cu). */
fq_status fq_cuda_fwd_wy_given(const fq_gdn_params *p, const fq_fwd_ws *ws, cudaStream_t stream);
/* The two stage A kernels (same outputs): the blocked one (A = (I+L)^-1, one
 * block per chunk and value head; fq_cuda_fwd_wy runs it) and the persistent one (
 * double-buffered loads, recursive-doubling inverse; fq_cuda_fwd_wy_recompute
 * runs it). Exported for dev/cuda/check_fwd_wy.cu. Same outputs except
 * from a chunk's first non-finite row f on (causality, issue 9): the
 * blocked one, as the three-stage forward's stage A, stores gamma NaN
 * there; the persistent one keeps it for the backward, scans g with its
 * non-finite values as 0 and stores W NaN from min(fl, first bad g row) on. */
fq_status fq_cuda_fwd_wy_blocked(const fq_gdn_params *p, const fq_fwd_ws *ws, cudaStream_t stream);
fq_status fq_cuda_fwd_wy_persistent(const fq_gdn_params *p, const fq_fwd_ws *ws, int with_u, cudaStream_t stream);
/* Stage B: writes ws->h, ws->vn and, when ht != NULL, ht [N, HV, K, V] fp32.
 * bv: state columns per block, 16, 32 or 64 (16 per warp or warp pair);
 * 0 picks by the number of 16-column chains vs SMs (always valid). */
fq_status fq_cuda_fwd_state(const fq_gdn_params *p, const fq_fwd_ws *ws, float *ht, int bv,
                            cudaStream_t stream);
/* Stage B with the K-split chosen too: ksplit 1 (one warp per 16 state
 * columns) or 2 (two warps, K/2 state rows each); 0 picks (for the
 * configuration sweep of dev/cuda/check_fwd.cu). */
fq_status fq_cuda_fwd_state_tiled(const fq_gdn_params *p, const fq_fwd_ws *ws, float *ht, int bv,
                                int ksplit, cudaStream_t stream);
/* Stage C: o from q, k, gamma, h, Vn. */
fq_status fq_cuda_fwd_output(const fq_gdn_params *p, const fq_fwd_ws *ws, cudaStream_t stream);
/* Fills o, ht and the checkpoints (those requested) with NaN when
 * ws->flags[0] is set (invalid cu_seqlens); otherwise does nothing. Other
 * outputs (the backward's) can be poisoned with fq_cuda_poison_if_invalid. */
fq_status fq_cuda_fwd_poison(const fq_gdn_params *p, const fq_fwd_ws *ws, cudaStream_t stream);
fq_status fq_cuda_poison_if_invalid(const int *flags, void *x, fq_dtype dt, int64_t n, cudaStream_t stream);

/* FLASHQLA_CHECK_INPUTS=1 (p->check_inputs): copies g, cu_seqlens and
 * state_indices to the host (a stream synchronisation, not capturable in a
 * CUDA graph) and runs the CPU backend's content checks on them
 * (fq_check_contents: cu_seqlens, duplicate or out-of-range slots, g > 0 or
 * NaN), before anything is launched. FQ_OK at once when the flag is off.
 * In gdn_cuda_runtime.cu; each entry point calls it after
 * fq_check_params_device. */
fq_status fq_cuda_check_contents(const fq_gdn_params *p, char op);
/* [serving] (issue 11). The gate region at the start of every chunk
 * workspace (op 'f' or 'b') and the pre-/post-passes of the fused gates
 * (gdn_cuda_gates.cu): fq_cuda_gates_begin copies p to out with the
 * workspace past the region and, with fused gates, float32 g, beta (and for
 * 'b' dg, dbeta) in it; fq_cuda_gates_end turns the backward's dg, dbeta into
 * p's da, db, dA_log, ddt_bias. */
size_t fq_cuda_gates_ws_bytes(const fq_gdn_params *p, char op);
fq_status fq_cuda_gates_begin(const fq_gdn_params *p, char op, fq_gdn_params *out, cudaStream_t stream);
fq_status fq_cuda_gates_end(const fq_gdn_params *p, const fq_gdn_params *q, cudaStream_t stream);
/* cu_checkpoints from the chunk table and the zero rows past the last
 * checkpoint (gdn_cuda_fwd_checkpoints.cu); after fq_cuda_fwd_prepare. */
fq_status fq_cuda_fwd_checkpoint_index(const fq_gdn_params *p, const fq_fwd_ws *ws, cudaStream_t stream);
/* CUDA-only rules of the serving options: A_log, dt_bias float32. */
fq_status fq_cuda_check_serving(const fq_gdn_params *p);

/* fn(p) with p->device current, the caller's device restored after: the
 * body of the entry points fq_cuda_chunk_fwd / _bwd / fq_cuda_recurrent. */
fq_status fq_cuda_on_device(const fq_gdn_params *p, fq_status (*fn)(const fq_gdn_params *p));

/* cudaFuncSetAttribute(kernel, attr, value), remembered per (kernel, device,
 * attribute): repeated calls are cheap. */
fq_status fq_cuda_func_attr(const void *kernel, cudaFuncAttribute attr, int value);
/* Raises a kernel's dynamic shared-memory limit (idempotent, cheap after the
 * first call per device). */
fq_status fq_cuda_set_smem(const void *kernel, int bytes);

/* 1 when the forward's stages A, B, C are launched as programmatic dependent
 * launches (below): the current device is sm_90 or newer and the environment
 * variable FLASHQLA_CUDA_PDL is not "0" (read once; a dev switch for timing
 * the difference). */
int fq_cuda_pdl_enabled(void);

#ifdef __cplusplus
}
#endif

/* ------------------------------------------ programmatic dependent launch ----
 *
 * A kernel launched with cudaLaunchAttributeProgrammaticStreamSerialization
 * may start while the kernel before it on the stream is still running: its
 * blocks are scheduled once every block of the previous kernel has executed
 * griddepcontrol.launch_dependents (fq_pdl_trigger) or exited. It must then
 * execute griddepcontrol.wait (fq_pdl_wait) before it reads anything the
 * previous kernel writes or writes anything the previous kernel reads: the
 * wait returns when the previous grid has completed and its memory is
 * visible. Rules kept by every kernel that can be launched this way:
 *   - before fq_pdl_wait it reads only the caller's inputs (complete before
 *     the first kernel of the call, which is launched without the attribute)
 *     and writes nothing in global memory: the kernels before it may have
 *     triggered early (the chunk table kernel does at its start, A and B
 *     too), so not even the chunk table is complete before the wait;
 *   - every block executes fq_pdl_wait, also a block that has nothing to do
 *     (else a grid of such blocks could complete before the one it follows,
 *     and a kernel waiting on it would not be ordered after that one).
 * Without the attribute both instructions are no-ops; before sm_90 they are
 * compiled out (the compute_80 PTX fallback never gets the attribute). */
static __device__ __forceinline__ void fq_pdl_wait(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
static __device__ __forceinline__ void fq_pdl_trigger(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

/* A ready flag between two kernels that run at once (the fused forward's
 * stage A beside its state pass, gdn_cuda_fwd_fused.cu): the writer's
 * threads store, meet at a barrier, then one of them publishes with
 * fq_flag_publish (a gpu-scope fence, then the flag); the reader spins on
 * fq_flag_ready (an acquire load) before it reads what the flag covers. */
static __device__ __forceinline__ void fq_flag_publish(int *flag)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    __threadfence();
    asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(flag), "r"(1) : "memory");
#else
    __threadfence();
    *(volatile int *)flag = 1;
#endif
}
static __device__ __forceinline__ int fq_flag_ready(const int *flag)
{
    int v;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(flag) : "memory");
#else
    v = *(const volatile int *)flag;
    __threadfence();
#endif
    return v;
}

#ifdef __cplusplus
/* <<<grid, block, smem, stream>>> with the programmatic-serialization
 * attribute when pdl != 0 (checked launch). */
template <typename... P, typename... A>
static fq_status fq_launch_k(void (*kernel)(P...), dim3 grid, unsigned block, size_t smem,
                             cudaStream_t stream, int pdl, A... args)
{
    cudaLaunchConfig_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.gridDim = grid;
    cfg.blockDim = dim3(block);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    FQ_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
    FQ_CUDA_CHECK_LAUNCH();
    return FQ_OK;
}
#endif

#endif /* FQ_GDN_CUDA_COMMON_CUH */
