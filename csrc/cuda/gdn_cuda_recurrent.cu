/*
 * gdn_cuda_recurrent.cu — the recurrent step (decode / multi-token verify):
 * the operator of DESIGN §1 token by token on a state pool updated in place.
 *
 *     alpha_t = e^{g_t}
 *     u_t     = beta_t (v_t - alpha_t S^T k_t)
 *     o_t     = scale S_t^T q_t = scale (alpha_t S^T q_t + u_t (k_t . q_t))
 *     S      <- alpha_t S + k_t u_t^T
 *
 * One block of 128 threads per (sequence, value head, 32 state columns): the
 * block reads its K x 32 fp32 tile of state[slot, j] once (16-byte loads),
 * keeps it in registers over the sequence's tokens, writes it back once.
 * Thread layout: 8 column groups of 4 (lane & 7) x 16 row groups of K/16 rows
 * (4 per warp). Per token one reduction over the rows gives S^T k, S^T q and,
 * for use_qk_l2norm, |q|^2, |k|^2, q.k (q = rq q_raw, k = rk k_raw).
 * Token inputs (q, k rows, the block's v columns) arrive by cp.async in a
 * ring of shared-memory slots, up to 7 tokens ahead (the version that loaded
 * them into registers one token ahead is in git history, commit 013b381, and
 * benchmarks/NOTES.md).
 *
 * slot = state_indices[n] (n without indices); slot < 0 or >= P: padding, o
 * rows of the sequence written as 0, the pool untouched; a slot an earlier
 * sequence already names: o rows NaN, the pool untouched (gdn.h). With cu_seqlens a
 * one-block kernel first validates the offsets into the workspace flag; when
 * invalid, every o element is NaN and the pool is untouched.
 */
#include "gdn_cuda_common.cuh"

struct fq_rec_args {
    const void *q, *k, *v, *g, *beta;
    fq_dtype dtype, gate_dtype;
    const void *cu;
    int cu_is64;
    const void *idx;
    int idx_is64;
    const int *flags; /* NULL without cu_seqlens */
    float *state;
    void *o;
    int64_t P, T;
    int H, HV, V;
    int l2norm;
    float scale;
};

static __device__ __forceinline__ int64_t fq_rec_index(const void *p, int is64, int64_t i)
{
    return is64 ? ((const int64_t *)p)[i] : (int64_t)((const int32_t *)p)[i];
}

#define FQ_REC_RED 11 /* S^T k (4), S^T q (4), k.q, |k|^2, |q|^2 */

/* one token's inputs for this thread */
template <int RK> struct fq_rec_tok {
    float q[RK], k[RK], v[4], g, b;
};

/* NE consecutive elements of a q, k or v row staged in shared memory in the
 * input dtype (raw bytes of the row; i = element index in the row). */
template <int NE>
static __device__ __forceinline__ void fq_ld_vec_smem(const unsigned char *row, fq_dtype dt, int i, float *out)
{
#pragma unroll
    for (int h = 0; h < NE; h++) {
        if (dt == FQ_F32) out[h] = ((const float *)row)[i + h];
        else if (dt == FQ_BF16) out[h] = __bfloat162float(((const __nv_bfloat16 *)row)[i + h]);
        else out[h] = __half2float(((const __half *)row)[i + h]);
    }
}

/* Staged token inputs: a ring of FQ_REC_RING token slots in shared
 * memory, each the raw q row, k row (K elements) and the block's 32 v
 * columns, filled by cp.async FQ_REC_RING - 1 tokens ahead, so a sequence of
 * several tokens (speculative verification, T > 1) does not wait for each
 * token's loads; gates go through a double-buffered window of 64 tokens. */
#define FQ_REC_RING 8
#define FQ_REC_GWIN 64
template <int K> struct fq_rec_ring {
    static constexpr int q = 0, k = K * 4, v = 2 * K * 4, slot = 2 * K * 4 + 32 * 4; /* fp32 worst case */
};

/* Resident blocks per SM asked of the compiler: the state tile in flight is
 * what bounds decode (16 KB per block at K = 128); 5 blocks cap K = 128 at
 * 96 registers (8 bytes of spill); unbounded it took 132 (3 blocks). K = 64
 * is left to the compiler. */
template <int K>
__global__ void __launch_bounds__(128, K == 128 ? 5 : 0) fq_recurrent_kernel(fq_rec_args args)
{
    constexpr int RK = K / 16; /* state rows per thread */
    typedef fq_rec_ring<K> RG;
    __shared__ float red[2][4][8][FQ_REC_RED + 1];
    __shared__ __align__(16) unsigned char ring[FQ_REC_RING][RG::slot];
    __shared__ float gwin[2][2][FQ_REC_GWIN]; /* [window parity][g, beta][token] */
    const int HV = args.HV, V = args.V, nvs = V / 32;
    const int vs = blockIdx.x % nvs, j = (blockIdx.x / nvs) % HV;
    const int64_t n = blockIdx.x / (nvs * HV);
    const int hq = j / (HV / args.H);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int vg = lane & 7, kg = warp * 4 + (lane >> 3);
    const int r0 = kg * RK, c0 = vs * 32 + vg * 4;

    int64_t bos, len;
    if (args.cu) {
        if (args.flags[0]) {
            /* invalid cu_seqlens: o <- NaN (grid-stride), pool untouched */
            int64_t total = args.T * HV * V;
            float nan = __int_as_float(0x7fc00000);
            for (int64_t i = (int64_t)blockIdx.x * 128 + tid; i < total; i += (int64_t)gridDim.x * 128)
                fq_st_f(args.o, args.dtype, i, nan);
            return;
        }
        bos = fq_rec_index(args.cu, args.cu_is64, n);
        len = fq_rec_index(args.cu, args.cu_is64, n + 1) - bos;
    } else {
        bos = n * args.T;
        len = args.T;
    }
    int64_t slot = args.idx ? fq_rec_index(args.idx, args.idx_is64, n) : n;
    if (slot < 0 || slot >= args.P) {
        /* padding: o rows 0 */
        if (kg == 0)
            for (int64_t t = 0; t < len; t++)
                for (int e = 0; e < 4; e++)
                    fq_st_f(args.o, args.dtype, ((bos + t) * HV + j) * V + c0 + e, 0.f);
        return;
    }
    /* issue 9: a slot that an earlier sequence names too (duplicate
     * state_indices; raised as ValueError only under FLASHQLA_CHECK_INPUTS=1,
     * which needs a host sync) belongs to that first sequence: this one
     * writes NaN rows and leaves the pool alone, so the result is the same
     * every run instead of a race between two blocks on one slot. The scan
     * reads state_indices[0..n) once per block (n / 128 loads per thread). */
    if (args.idx) {
        int dup = 0;
        for (int64_t m = tid; m < n && !dup; m += 128) dup = fq_rec_index(args.idx, args.idx_is64, m) == slot;
        if (__syncthreads_or(dup)) {
            if (kg == 0) {
                const float nan = __int_as_float(0x7fc00000);
                for (int64_t t = 0; t < len; t++)
                    for (int e = 0; e < 4; e++)
                        fq_st_f(args.o, args.dtype, ((bos + t) * HV + j) * V + c0 + e, nan);
            }
            return;
        }
    }

    float S[RK][4];
    float *sp = args.state + ((slot * HV + j) * (int64_t)K + r0) * V + c0;
#pragma unroll
    for (int i = 0; i < RK; i++) {
        float4 x = *(const float4 *)(sp + (int64_t)i * V);
        S[i][0] = x.x; S[i][1] = x.y; S[i][2] = x.z; S[i][3] = x.w;
    }

    /* token t's raw rows into ring slot t % FQ_REC_RING (one cp.async
     * group per token, possibly empty; threads 0.. copy 16 bytes each) */
    const int es = args.dtype == FQ_F32 ? 4 : 2;
    auto issue_tok = [&](int64_t t) {
        if (t < len) {
            const int64_t row = bos + t;
            const int nq = K * es / 16, nv = 32 * es / 16;
            unsigned char *slot = ring[t % FQ_REC_RING];
            const unsigned char *src = NULL;
            unsigned char *dst = NULL;
            if (tid < nq) {
                src = (const unsigned char *)args.q + (row * args.H + hq) * K * es + tid * 16;
                dst = slot + RG::q + tid * 16;
            } else if (tid < 2 * nq) {
                src = (const unsigned char *)args.k + (row * args.H + hq) * K * es + (tid - nq) * 16;
                dst = slot + RG::k + (tid - nq) * 16;
            } else if (tid < 2 * nq + nv) {
                src = (const unsigned char *)args.v + ((row * HV + j) * V + vs * 32) * es + (tid - 2 * nq) * 16;
                dst = slot + RG::v + (tid - 2 * nq) * 16;
            }
            if (dst) fq_cp_async16(dst, src, 16);
        }
        fq_cp_async_commit();
    };
    /* gates of tokens t0 .. t0 + 63 into window (t0 / 64) & 1 */
    auto load_gates = [&](int64_t t0) {
        const int w = (int)((t0 / FQ_REC_GWIN) & 1), i = tid & (FQ_REC_GWIN - 1), which = tid / FQ_REC_GWIN;
        if (t0 + i < len) {
            const int64_t gi = (bos + t0 + i) * HV + j;
            gwin[w][which][i] = fq_ld_f(which ? args.beta : args.g, args.gate_dtype, gi);
        }
    };
    static_assert(2 * FQ_REC_GWIN == 128, "one gate per thread");

    fq_rec_tok<RK> cur;
    for (int s = 0; s < FQ_REC_RING - 1; s++) issue_tok(s);
    load_gates(0);
    fq_cp_async_wait<FQ_REC_RING - 2>(); /* token 0 (this thread's part) */
    __syncthreads();

    for (int64_t t = 0; t < len; t++) {
        const int64_t row = bos + t;
        {
            /* token t is visible (the previous barrier); its slot is read
             * into registers here, so slot (t - 1) % RING is free now */
            const unsigned char *slot = ring[t % FQ_REC_RING];
            fq_ld_vec_smem<RK>(slot + RG::q, args.dtype, r0, cur.q);
            fq_ld_vec_smem<RK>(slot + RG::k, args.dtype, r0, cur.k);
            fq_ld_vec_smem<4>(slot + RG::v, args.dtype, vg * 4, cur.v);
            const int w = (int)((t / FQ_REC_GWIN) & 1), i = (int)(t & (FQ_REC_GWIN - 1));
            cur.g = gwin[w][0][i];
            cur.b = gwin[w][1][i];
            issue_tok(t + FQ_REC_RING - 1);
            /* the next gate window, published by this token's barrier; its
             * buffer was last read two windows ago */
            if (i == FQ_REC_GWIN - 1) load_gates(t + 1);
        }
        const float *qv = cur.q, *kv = cur.k, *vv = cur.v;
        const float gt = cur.g, bt = cur.b;

        float part[FQ_REC_RED];
#pragma unroll
        for (int e = 0; e < FQ_REC_RED; e++) part[e] = 0.f;
#pragma unroll
        for (int i = 0; i < RK; i++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                part[e] += S[i][e] * kv[i];
                part[4 + e] += S[i][e] * qv[i];
            }
            part[8] += kv[i] * qv[i];
            part[9] += kv[i] * kv[i];
            part[10] += qv[i] * qv[i];
        }
        /* sum over the 4 row groups of the warp (lane bits 3, 4), then warps */
#pragma unroll
        for (int e = 0; e < FQ_REC_RED; e++) {
            part[e] += __shfl_xor_sync(0xffffffffu, part[e], 8);
            part[e] += __shfl_xor_sync(0xffffffffu, part[e], 16);
        }
        float(*rb)[8][FQ_REC_RED + 1] = red[t & 1];
        if (lane < 8)
#pragma unroll
            for (int e = 0; e < FQ_REC_RED; e++) rb[warp][vg][e] = part[e];
        /* token t + 1 (this thread's copies) landed; the barrier below makes
         * it, the partial sums and a new gate window visible */
        fq_cp_async_wait<FQ_REC_RING - 2>();
        __syncthreads();
        float tot[FQ_REC_RED];
#pragma unroll
        for (int e = 0; e < FQ_REC_RED; e++)
            tot[e] = rb[0][vg][e] + rb[1][vg][e] + rb[2][vg][e] + rb[3][vg][e];

        float rq = 1.f, rk = 1.f;
        if (args.l2norm) {
            rk = rsqrtf(tot[9] + 1e-6f);
            rq = rsqrtf(tot[10] + 1e-6f);
        }
        const float alpha = __expf(gt);
        const float kq = tot[8] * rk * rq;
        float u[4], ov[4];
#pragma unroll
        for (int e = 0; e < 4; e++) {
            u[e] = bt * (vv[e] - alpha * rk * tot[e]);
            ov[e] = args.scale * (alpha * rq * tot[4 + e] + u[e] * kq);
        }
        if (kg == 0) {
            int64_t ob = (row * HV + j) * V + c0;
#pragma unroll
            for (int e = 0; e < 4; e += 2) fq_st_f2(args.o, args.dtype, ob + e, ov[e], ov[e + 1]);
        }
#pragma unroll
        for (int i = 0; i < RK; i++) {
            float kn = rk * kv[i];
#pragma unroll
            for (int e = 0; e < 4; e++) S[i][e] = alpha * S[i][e] + kn * u[e];
        }
    }
    fq_cp_async_wait<0>(); /* nothing in flight at exit */

#pragma unroll
    for (int i = 0; i < RK; i++)
        *(float4 *)(sp + (int64_t)i * V) = make_float4(S[i][0], S[i][1], S[i][2], S[i][3]);
}

/* One block: flags[0] = 1 when cu_seqlens does not start at 0, decreases, or
 * does not end at T. */
__global__ void fq_rec_validate_kernel(const void *cu, int is64, int64_t N, int64_t T, int *flags)
{
    __shared__ int bad;
    if (threadIdx.x == 0) bad = 0;
    __syncthreads();
    for (int64_t i = threadIdx.x; i <= N; i += blockDim.x) {
        int64_t c = fq_rec_index(cu, is64, i);
        int b = c < 0 || c > T || (i == 0 && c != 0) || (i == N && c != T);
        if (i > 0 && c < fq_rec_index(cu, is64, i - 1)) b = 1;
        if (b) atomicOr(&bad, 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) flags[0] = bad;
}

#define FQ_REC_WS 256

extern "C" size_t fq_cuda_recurrent_workspace_bytes(const fq_gdn_params *p)
{
    (void)p;
    return FQ_REC_WS; /* the cu_seqlens validity flag */
}

static fq_status fq_recurrent_on_device(const fq_gdn_params *p)
{
    cudaStream_t stream = (cudaStream_t)p->stream;
    fq_rec_args a;
    a.q = p->q; a.k = p->k; a.v = p->v; a.g = p->g; a.beta = p->beta;
    a.dtype = p->dtype;
    a.gate_dtype = p->gate_dtype;
    a.cu = p->cu_seqlens;
    a.cu_is64 = p->cu_seqlens_is_int64;
    a.idx = p->state_indices;
    a.idx_is64 = p->state_indices_is_int64;
    a.flags = NULL;
    a.state = (float *)p->state;
    a.o = p->o;
    a.P = p->P;
    a.T = p->T;
    a.H = (int)p->H;
    a.HV = (int)p->HV;
    a.V = (int)p->V;
    a.l2norm = p->use_qk_l2norm;
    a.scale = (float)p->scale;
    if (p->cu_seqlens) {
        fq_status st = fq_cuda_check_workspace(p, FQ_REC_WS);
        if (st != FQ_OK) return st;
        a.flags = (const int *)p->workspace;
        fq_rec_validate_kernel<<<1, 256, 0, stream>>>(p->cu_seqlens, p->cu_seqlens_is_int64, p->N, p->T,
                                                      (int *)p->workspace);
        FQ_CUDA_CHECK_LAUNCH();
    }
    int64_t blocks = p->N * p->HV * (p->V / 32);
    if (blocks <= 0) return FQ_OK;
    if (p->K == 128) fq_recurrent_kernel<128><<<(unsigned)blocks, 128, 0, stream>>>(a);
    else fq_recurrent_kernel<64><<<(unsigned)blocks, 128, 0, stream>>>(a);
    FQ_CUDA_CHECK_LAUNCH();
    return FQ_OK;
}

extern "C" fq_status fq_cuda_recurrent(const fq_gdn_params *p)
{
    fq_status st = fq_check_params_device(p, 'r');
    if (st != FQ_OK) return st;
    if ((st = fq_cuda_fwd_check_sizes(p)) != FQ_OK) return st;
    if ((st = fq_cuda_check_contents(p, 'r')) != FQ_OK) return st; /* FLASHQLA_CHECK_INPUTS=1 */
    if ((((uintptr_t)p->state | (uintptr_t)p->q | (uintptr_t)p->k | (uintptr_t)p->v) & 15) ||
        (((uintptr_t)p->o) & 7))
        return fq_fail(FQ_ERR_VALUE,
                       "q, k, v, state, o: CUDA buffers must be 16-byte aligned (o: 8-byte)");
    return fq_cuda_on_device(p, fq_recurrent_on_device);
}
