/*
 * gdn_cuda_recurrent.cu — the recurrent step (decode / multi-token verify):
 * the operator of DESIGN §1 token by token on a state pool.
 *
 *     alpha_t = e^{g_t}
 *     u_t     = beta_t (v_t - alpha_t S^T k_t)
 *     o_t     = scale S_t^T q_t = scale (alpha_t S^T q_t + u_t (k_t . q_t))
 *     S      <- alpha_t S + k_t u_t^T
 *
 * One warp per (sequence n, value head j, 8 state columns); no shared
 * memory and no block barrier. Lane l holds the K/16 state rows
 * r0 = (l & 15) * K/16 .. of the 4 columns c0 = 8 w + 4 (l >> 4) ..
 * (fp32 registers, read from the pool once, written back once). Per token:
 *
 *     partial sums over the lane's rows of S^T k, S^T q (4 columns each) and
 *     of k.q, |k|^2, |q|^2 (for use_qk_l2norm: q = rq q_raw, k = rk k_raw)
 *     -> a butterfly over the 16 row groups (__shfl_xor 1, 2, 4, 8): every
 *     lane has the totals, computes u and o for its 4 columns and updates
 *     its rows; lanes 0 and 16 store o.
 *
 * The serial chain of a T = 1 step is: launch -> (slot, cu_seqlens and all
 * token inputs in flight together) -> the state tile (a dependent load of the
 * slot) -> 11 x RK FMAs, 4 shuffle rounds -> stores. Token inputs are loaded
 * through the read-only path (ld.global.nc) in groups of NPF tokens
 * (1 for T = 1, else 4), a group's loads all in flight at once; the first
 * group is issued before the state tile. Warps per block: 4, fewer when
 * that would leave SMs without two blocks (N = 1, HV = 32: 512 warps as 512
 * blocks of one warp, all resident at once).
 *
 * slot = state_indices[n] (n without indices); slot < 0 or >= P: padding, o
 * rows of the sequence written as 0, the pool untouched; a slot an earlier
 * sequence already names (duplicate state_indices, raised as ValueError only
 * under FLASHQLA_CHECK_INPUTS=1): o rows NaN, nothing written, so the slot
 * belongs to its first sequence every run (gdn.h). state_vk: the pool
 * (and intermediate_states) are [.., V, K]. intermediate_states: the state
 * after each token t to [n, t]; no_state_update: the pool is only read.
 * With cu_seqlens a one-block kernel first validates the offsets (and, with
 * intermediate_states, that no sequence has more than Ti tokens) into the
 * workspace flag; when invalid, every o element is NaN and nothing else is
 * written.
 *
 * The previous kernel (one block of 128 threads per 32 columns, a
 * shared-memory reduction and a cp.async ring of token inputs) is in git
 * history (commit ea9c650) and benchmarks/NOTES.md.
 */
#include "gdn_cuda_common.cuh"

struct fq_rec_args {
    const void *q, *k, *v, *g, *beta;
    fq_dtype dtype, gate_dtype;
    const float *A_log, *dt_bias; /* fused gates (NULL: g is the log decay) */
    int beta_sigmoid;
    const void *cu;
    int cu_is64;
    const void *idx;
    int idx_is64;
    const int *flags; /* NULL without cu_seqlens */
    float *state;
    float *inter;     /* intermediate_states or NULL */
    int64_t Ti;
    int update, vk;
    void *o;
    int64_t P, T, N;
    int H, HV, V;
    int l2norm;
    float scale;
};

static __device__ __forceinline__ int64_t fq_rec_index(const void *p, int is64, int64_t i)
{
    return is64 ? ((const int64_t *)p)[i] : (int64_t)((const int32_t *)p)[i];
}

/* One element of a gate array through the read-only path, as float. */
static __device__ __forceinline__ float fq_ldg_f(const void *p, fq_dtype dt, int64_t i)
{
    switch (dt) {
    case FQ_F32: return __ldg((const float *)p + i);
    case FQ_F16: return __half2float(__ldg((const __half *)p + i));
    default: return __bfloat162float(__ldg((const fq_bf16 *)p + i));
    }
}

/* BYTES (8, 16 or 32) raw bytes at p (BYTES-aligned... at least 8) via ld.global.nc. */
template <int BYTES>
static __device__ __forceinline__ void fq_ldg_raw(uint32_t *w, const void *p)
{
    if constexpr (BYTES == 8) {
        const uint2 x = __ldg((const uint2 *)p);
        w[0] = x.x; w[1] = x.y;
    } else {
        static_assert(BYTES == 16 || BYTES == 32, "8, 16 or 32 bytes");
#pragma unroll
        for (int h = 0; h < BYTES / 16; h++) {
            const uint4 x = __ldg((const uint4 *)p + h);
            w[4 * h] = x.x; w[4 * h + 1] = x.y; w[4 * h + 2] = x.z; w[4 * h + 3] = x.w;
        }
    }
}

/* NE elements of ES bytes (4: float32; 2: bfloat16 or float16 per dt) -> float */
template <int NE, int ES>
static __device__ __forceinline__ void fq_raw_to_f(const uint32_t *w, fq_dtype dt, float *out)
{
#pragma unroll
    for (int h = 0; h < NE; h++) {
        if constexpr (ES == 4) {
            out[h] = __uint_as_float(w[h]);
        } else {
            const unsigned short b = (unsigned short)(w[h >> 1] >> (16 * (h & 1)));
            out[h] = dt == FQ_BF16 ? __uint_as_float((uint32_t)b << 16) : __half2float(__ushort_as_half(b));
        }
    }
}

/* One token's inputs for a lane, raw: q, k of its RK rows, v of its 4
 * columns, and the gates the operator uses (fused gates applied). */
template <int RK, int ES> struct fq_rec_tok {
    uint32_t q[RK * ES / 4], k[RK * ES / 4], v[ES];
    float g, b;
};

template <int RK, int ES>
static __device__ __forceinline__ void fq_rec_load_tok(fq_rec_tok<RK, ES> &x, const fq_rec_args &a, int64_t row,
                                                       int hq, int j, int r0, int c0, float Aexp, float dtb)
{
    const unsigned char *q = (const unsigned char *)a.q, *k = (const unsigned char *)a.k;
    const unsigned char *v = (const unsigned char *)a.v;
    const int64_t qo = (row * a.H + hq) * (int64_t)(16 * RK) + r0; /* K = 16 RK */
    fq_ldg_raw<RK * ES>(x.q, q + qo * ES);
    fq_ldg_raw<RK * ES>(x.k, k + qo * ES);
    fq_ldg_raw<4 * ES>(x.v, v + ((row * a.HV + j) * a.V + c0) * ES);
    const int64_t gi = row * a.HV + j;
    const float graw = fq_ldg_f(a.g, a.gate_dtype, gi), braw = fq_ldg_f(a.beta, a.gate_dtype, gi);
    /* fused gates: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) */
    if (a.A_log) {
        const float xg = graw + dtb;
        x.g = -Aexp * (xg > 20.f ? xg : log1pf(__expf(xg)));
    } else {
        x.g = graw;
    }
    x.b = a.beta_sigmoid ? 1.f / (1.f + __expf(-braw)) : braw;
}

/* The lane's RK x 4 tile at base (a state [K][V], or [V][K] with vk): kv as
 * RK float4 (one per row), vk as 4 x RK/4 float4 (RK rows of a column). */
template <int RK>
static __device__ __forceinline__ void fq_rec_tile_load(float S[RK][4], const float *base, int r0, int c0, int K,
                                                        int V, int vk)
{
    if (!vk) {
#pragma unroll
        for (int i = 0; i < RK; i++) {
            const float4 x = *(const float4 *)(base + (int64_t)(r0 + i) * V + c0);
            S[i][0] = x.x; S[i][1] = x.y; S[i][2] = x.z; S[i][3] = x.w;
        }
    } else {
#pragma unroll
        for (int e = 0; e < 4; e++)
#pragma unroll
            for (int i = 0; i < RK; i += 4) {
                const float4 x = *(const float4 *)(base + (int64_t)(c0 + e) * K + r0 + i);
                S[i][e] = x.x; S[i + 1][e] = x.y; S[i + 2][e] = x.z; S[i + 3][e] = x.w;
            }
    }
}

template <int RK>
static __device__ __forceinline__ void fq_rec_tile_store(const float S[RK][4], float *base, int r0, int c0, int K,
                                                         int V, int vk)
{
    if (!vk) {
#pragma unroll
        for (int i = 0; i < RK; i++)
            *(float4 *)(base + (int64_t)(r0 + i) * V + c0) = make_float4(S[i][0], S[i][1], S[i][2], S[i][3]);
    } else {
#pragma unroll
        for (int e = 0; e < 4; e++)
#pragma unroll
            for (int i = 0; i < RK; i += 4)
                *(float4 *)(base + (int64_t)(c0 + e) * K + r0 + i) =
                    make_float4(S[i][e], S[i + 1][e], S[i + 2][e], S[i + 3][e]);
    }
}

#define FQ_REC_RED 11 /* S^T k (4), S^T q (4), k.q, |k|^2, |q|^2 */

/* Resident blocks of 4 warps per SM asked of the compiler: the state in
 * flight is what bounds decode (4 KB per warp). T = 1: 5 (96 registers, 8-16
 * bytes of spill at K = 128; unbounded 118-128: 4); groups of 4 tokens at
 * K = 128 left to the compiler (156-168 registers; bounded to 128 they
 * spill 52-416 bytes), at K = 64 4 (117-128, no spill; unbounded 212). */
template <int K, int NPF> struct fq_rec_minb {
    static constexpr int value = NPF == 1 ? 5 : (K == 64 ? 4 : 1);
};

template <int K, int NPF, int ES>
__global__ void __launch_bounds__(128, (fq_rec_minb<K, NPF>::value)) fq_recurrent_kernel(fq_rec_args a)
{
    constexpr int RK = K / 16; /* state rows per lane */
    const int lane = threadIdx.x & 31;
    const int64_t wid = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int HV = a.HV, V = a.V, nvw = V / 8;
    if (wid >= a.N * HV * nvw) return;
    const int vw = (int)(wid % nvw), j = (int)((wid / nvw) % HV);
    const int64_t n = wid / ((int64_t)nvw * HV);
    const int hq = j / (HV / a.H);
    const int rg = lane & 15, r0 = rg * RK, c0 = vw * 8 + (lane >> 4) * 4;

    /* independent loads first: validity flag, sequence bounds (clamped to
     * [0, T], so that even invalid offsets never read out of bounds), slot */
    const int bad = a.flags ? a.flags[0] : 0;
    int64_t bos, len;
    if (a.cu) {
        int64_t b0 = fq_rec_index(a.cu, a.cu_is64, n), b1 = fq_rec_index(a.cu, a.cu_is64, n + 1);
        b0 = b0 < 0 ? 0 : (b0 > a.T ? a.T : b0);
        b1 = b1 < b0 ? b0 : (b1 > a.T ? a.T : b1);
        bos = b0;
        len = b1 - b0;
    } else {
        bos = n * a.T;
        len = a.T;
    }
    const int64_t slot = a.idx ? fq_rec_index(a.idx, a.idx_is64, n) : n;
    const float Aexp = a.A_log ? __expf(__ldg(a.A_log + j)) : 0.f;
    const float dtb = a.dt_bias ? __ldg(a.dt_bias + j) : 0.f;

    /* the first group's token inputs (they depend on bos only) */
    fq_rec_tok<RK, ES> tok[NPF];
#pragma unroll
    for (int i = 0; i < NPF; i++)
        if (i < len) fq_rec_load_tok<RK, ES>(tok[i], a, bos + i, hq, j, r0, c0, Aexp, dtb);

    if (bad) {
        /* invalid cu_seqlens: o <- NaN (grid-stride), nothing else written */
        const int64_t total = a.T * HV * V, nth = (int64_t)gridDim.x * blockDim.x;
        const float nan = __int_as_float(0x7fc00000);
        for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += nth)
            fq_st_f(a.o, a.dtype, i, nan);
        return;
    }
    if (slot < 0 || slot >= a.P) {
        /* padding: o rows 0, the pool untouched */
        if (rg == 0)
            for (int64_t t = 0; t < len; t++) {
                const int64_t ob = ((bos + t) * HV + j) * V + c0;
                fq_st_f2(a.o, a.dtype, ob, 0.f, 0.f);
                fq_st_f2(a.o, a.dtype, ob + 2, 0.f, 0.f);
            }
        return;
    }
    if (len == 0) return;

    float S[RK][4];
    float *sp = a.state + (slot * HV + j) * (int64_t)K * V;
    fq_rec_tile_load<RK>(S, sp, r0, c0, K, V, a.vk);
    /* a slot an earlier sequence names too belongs to that one (issue 9):
     * scan state_indices[0 .. n) (n / 32 loads per lane, in flight with the
     * state tile and with each other: no early exit, whose test on each
     * loaded value made the loads one dependent round trip after another,
     * 8 at N = 256), NaN rows and no state writes here */
    if (a.idx) {
        int dup = 0;
#pragma unroll 4
        for (int64_t m = lane; m < n; m += 32) dup |= fq_rec_index(a.idx, a.idx_is64, m) == slot;
        if (__any_sync(0xffffffffu, dup)) {
            if (rg == 0) {
                const float nan = __int_as_float(0x7fc00000);
                for (int64_t t = 0; t < len; t++) {
                    const int64_t ob = ((bos + t) * HV + j) * V + c0;
                    fq_st_f2(a.o, a.dtype, ob, nan, nan);
                    fq_st_f2(a.o, a.dtype, ob + 2, nan, nan);
                }
            }
            return;
        }
    }

    for (int64_t t0 = 0; t0 < len; t0 += NPF) {
        if (t0 > 0) /* the next group's inputs, all in flight at once */
#pragma unroll
            for (int i = 0; i < NPF; i++)
                if (t0 + i < len) fq_rec_load_tok<RK, ES>(tok[i], a, bos + t0 + i, hq, j, r0, c0, Aexp, dtb);
#pragma unroll
        for (int i = 0; i < NPF; i++) {
            const int64_t t = t0 + i;
            if (t >= len) break;
            float qv[RK], kv[RK], vv[4];
            fq_raw_to_f<RK, ES>(tok[i].q, a.dtype, qv);
            fq_raw_to_f<RK, ES>(tok[i].k, a.dtype, kv);
            fq_raw_to_f<4, ES>(tok[i].v, a.dtype, vv);

            float part[FQ_REC_RED];
#pragma unroll
            for (int e = 0; e < FQ_REC_RED; e++) part[e] = 0.f;
#pragma unroll
            for (int r = 0; r < RK; r++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    part[e] += S[r][e] * kv[r];
                    part[4 + e] += S[r][e] * qv[r];
                }
                part[8] += kv[r] * qv[r];
                part[9] += kv[r] * kv[r];
                part[10] += qv[r] * qv[r];
            }
            /* sum over the 16 row groups (lane bits 0..3): every lane gets the totals */
#pragma unroll
            for (int m = 1; m < 16; m <<= 1)
#pragma unroll
                for (int e = 0; e < FQ_REC_RED; e++) part[e] += __shfl_xor_sync(0xffffffffu, part[e], m);

            float rq = 1.f, rk = 1.f;
            if (a.l2norm) {
                rk = rsqrtf(part[9] + 1e-6f);
                rq = rsqrtf(part[10] + 1e-6f);
            }
            const float alpha = __expf(tok[i].g), bt = tok[i].b;
            const float kq = part[8] * rk * rq;
            float u[4], ov[4];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                u[e] = bt * (vv[e] - alpha * rk * part[e]);
                ov[e] = a.scale * (alpha * rq * part[4 + e] + u[e] * kq);
            }
            if (rg == 0) {
                const int64_t ob = ((bos + t) * HV + j) * V + c0;
                fq_st_f2(a.o, a.dtype, ob, ov[0], ov[1]);
                fq_st_f2(a.o, a.dtype, ob + 2, ov[2], ov[3]);
            }
#pragma unroll
            for (int r = 0; r < RK; r++) {
                const float kn = rk * kv[r];
#pragma unroll
                for (int e = 0; e < 4; e++) S[r][e] = alpha * S[r][e] + kn * u[e];
            }
            if (a.inter) /* the state after token t (speculative verify) */
                fq_rec_tile_store<RK>(S, a.inter + ((n * a.Ti + t) * HV + j) * (int64_t)K * V, r0, c0, K, V, a.vk);
        }
    }
    if (a.update) fq_rec_tile_store<RK>(S, sp, r0, c0, K, V, a.vk);
}

/* One block: flags[0] = 1 when cu_seqlens does not start at 0, decreases,
 * does not end at T, or (Ti > 0) holds a sequence longer than Ti. */
__global__ void fq_rec_validate_kernel(const void *cu, int is64, int64_t N, int64_t T, int64_t Ti, int *flags)
{
    __shared__ int bad;
    if (threadIdx.x == 0) bad = 0;
    __syncthreads();
    for (int64_t i = threadIdx.x; i <= N; i += blockDim.x) {
        int64_t c = fq_rec_index(cu, is64, i);
        int b = c < 0 || c > T || (i == 0 && c != 0) || (i == N && c != T);
        if (i > 0) {
            const int64_t prev = fq_rec_index(cu, is64, i - 1);
            if (c < prev || (Ti > 0 && c - prev > Ti)) b = 1;
        }
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

template <int K, int NPF>
static void fq_rec_launch(const fq_rec_args &a, unsigned blocks, unsigned threads, cudaStream_t stream)
{
    if (a.dtype == FQ_F32) fq_recurrent_kernel<K, NPF, 4><<<blocks, threads, 0, stream>>>(a);
    else fq_recurrent_kernel<K, NPF, 2><<<blocks, threads, 0, stream>>>(a);
}

static fq_status fq_recurrent_on_device(const fq_gdn_params *p)
{
    cudaStream_t stream = (cudaStream_t)p->stream;
    fq_rec_args a;
    memset(&a, 0, sizeof a);
    a.q = p->q; a.k = p->k; a.v = p->v; a.g = p->g; a.beta = p->beta;
    a.dtype = p->dtype;
    a.gate_dtype = p->gate_dtype;
    a.A_log = p->use_gate_in_kernel ? (const float *)p->A_log : NULL;
    a.dt_bias = p->use_gate_in_kernel ? (const float *)p->dt_bias : NULL;
    a.beta_sigmoid = p->use_beta_sigmoid_in_kernel;
    a.cu = p->cu_seqlens;
    a.cu_is64 = p->cu_seqlens_is_int64;
    a.idx = p->state_indices;
    a.idx_is64 = p->state_indices_is_int64;
    a.flags = NULL;
    a.state = (float *)p->state;
    a.inter = (float *)p->intermediate_states;
    a.Ti = p->Ti;
    a.update = !p->no_state_update;
    a.vk = p->state_vk;
    a.o = p->o;
    a.P = p->P;
    a.T = p->T;
    a.N = p->N;
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
                                                      p->intermediate_states ? p->Ti : 0, (int *)p->workspace);
        FQ_CUDA_CHECK_LAUNCH();
    }
    const int64_t warps = p->N * p->HV * (p->V / 8);
    if (warps <= 0) return FQ_OK;
    int dev = 0, sms = 132;
    FQ_CUDA_CHECK(cudaGetDevice(&dev));
    FQ_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    /* 4 warps per block unless that leaves SMs without two blocks; V / 8 is
     * 8 or 16, so warps is a multiple of every choice */
    int nw = 4;
    while (nw > 1 && warps / nw < 2 * (int64_t)sms) nw /= 2;
    const unsigned blocks = (unsigned)(warps / nw), threads = 32u * (unsigned)nw;
    /* T = 1 (without cu_seqlens, the decode step): one token in registers;
     * otherwise groups of 4 */
    const int one = !p->cu_seqlens && p->T <= 1;
    if (p->K == 128) {
        if (one) fq_rec_launch<128, 1>(a, blocks, threads, stream);
        else fq_rec_launch<128, 4>(a, blocks, threads, stream);
    } else {
        if (one) fq_rec_launch<64, 1>(a, blocks, threads, stream);
        else fq_rec_launch<64, 4>(a, blocks, threads, stream);
    }
    FQ_CUDA_CHECK_LAUNCH();
    return FQ_OK;
}

/* CUDA-only rules of the serving options (gate parameters in float32). */
extern "C" fq_status fq_cuda_check_serving(const fq_gdn_params *p)
{
    if (p->use_gate_in_kernel && p->gate_param_dtype != FQ_F32)
        return fq_fail(FQ_ERR_TYPE, "A_log: the CUDA backend takes float32 A_log and dt_bias, got %s",
                       fq_dtype_name(p->gate_param_dtype));
    return FQ_OK;
}

extern "C" fq_status fq_cuda_recurrent(const fq_gdn_params *p)
{
    fq_status st = fq_check_params_device(p, 'r');
    if (st != FQ_OK) return st;
    if ((st = fq_cuda_fwd_check_sizes(p)) != FQ_OK) return st;
    if ((st = fq_cuda_check_contents(p, 'r')) != FQ_OK) return st; /* FLASHQLA_CHECK_INPUTS=1 */
    if ((st = fq_cuda_check_serving(p)) != FQ_OK) return st;
    if ((((uintptr_t)p->state | (uintptr_t)p->q | (uintptr_t)p->k | (uintptr_t)p->v |
          (uintptr_t)p->intermediate_states) & 15) ||
        (((uintptr_t)p->o) & 7))
        return fq_fail(FQ_ERR_VALUE, "q, k, v, state, intermediate_states, o: CUDA buffers must be "
                                     "16-byte aligned (o: 8-byte)");
    return fq_cuda_on_device(p, fq_recurrent_on_device);
}
