/*
 * gdn_cuda_recurrent.cu — the recurrent step (decode / multi-token verify):
 * the operator of DESIGN §1 token by token on a state pool.
 *
 *     alpha_t = e^{g_t}
 *     u_t     = beta_t (v_t - alpha_t S^T k_t)
 *     o_t     = scale S_t^T q_t = scale (alpha_t S^T q_t + u_t (k_t . q_t))
 *     S      <- alpha_t S + k_t u_t^T
 *
 * One warp per item (sequence n, value head j, 8 state columns). Lane l
 * holds K/16 state rows of 4 columns in fp32 registers (fq_rec_f4_offset
 * says which), read once and written back once. Per token:
 *
 *     partial sums over the lane's rows of S^T k, S^T q (4 columns each) and
 *     of k.q, |k|^2, |q|^2 (for use_qk_l2norm: q = rq q_raw, k = rk k_raw)
 *     -> a butterfly over the 16 row groups (__shfl_xor 1, 2, 4, 8): every
 *     lane has the totals, computes u and o for its 4 columns and updates
 *     its rows; lanes 0 and 16 store o.
 *
 * A block of NW warps takes NW adjacent items at a time (a block item, 8 NW
 * columns); the grid is what is resident at once and block b walks block
 * items b, b + G, b + 2G, ... While it computes one, the next one's state
 * tile and first NPF tokens (q, k rows, v columns: 1 token for T = 1, else 4)
 * are on their way into the block's other shared-memory stage (cp.async by
 * all its threads, along memory: a [K, V] tile 128 contiguous bytes per row
 * at NW = 4, a [V, K] tile one contiguous run), its gates into registers, and
 * the index loads (cu_seqlens, state_indices) of the block item after that
 * are in flight: no load is waited for where it is issued, every block keeps
 * a tile in flight (decode is bound by the bytes in flight per SM), one block
 * barrier per item. NW = 4, fewer when that would leave SMs without a block
 * (N = 1, HV = 32: 256 blocks of 2 warps). Launched with programmatic
 * dependent launch: the blocks of a decode step are resident while the step
 * before finishes, and wait for it (griddepcontrol.wait) before their first
 * load.
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
 * The kernels before it (one block of 128 threads per 32 columns with a
 * shared-memory reduction, commit ea9c650; one warp per item without
 * prefetch, commit d791258; per-warp stages, commit c6a0c89) are in git
 * history and benchmarks/NOTES.md.
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

/* One element of a gate array through the read-only path, as float. */
static __device__ __forceinline__ float fq_ldg_f(const void *p, fq_dtype dt, int64_t i)
{
    switch (dt) {
    case FQ_F32: return __ldg((const float *)p + i);
    case FQ_F16: return __half2float(__ldg((const __half *)p + i));
    default: return __bfloat162float(__ldg((const fq_bf16 *)p + i));
    }
}

/* ------------------------------------------------------------ staging ----
 *
 * A block of NW warps (1, 2 or 4) takes one block item at a time: (sequence
 * n, value head j, 8 NW columns), warp w of it the 8 columns 8 w .. of the
 * group. Each block owns two stages in shared memory. A stage holds the
 * block item's state tile (K rows x 8 NW columns, fp32) and the raw q row,
 * k row and v columns of its first NPF tokens, copied there by cp.async
 * (all threads of the block together) while the block computes the item
 * before it. The copy runs along memory: [K, V] 16 rows of 32 NW contiguous
 * bytes per warp instruction (128 bytes at NW = 4), [V, K] the tile is one
 * contiguous run. Tokens: [q: K | k: K | v: 8 NW] elements per token. */
template <int K, int NPF, int ES> struct fq_rec_stage {
    static constexpr int RK = K / 16;            /* float4 of state per thread */
    static constexpr int qk_bytes = K * ES;      /* one q (or k) row */
    static __host__ __device__ constexpr int state_bytes(int nw) { return RK * 512 * nw; }
    static __host__ __device__ constexpr int tok_bytes(int nw) { return 2 * qk_bytes + 8 * nw * ES; }
    static __host__ __device__ constexpr int bytes(int nw) { return state_bytes(nw) + NPF * tok_bytes(nw); }
};

/* The 16-byte slot of state slot s in a stage. [K, V]: s = row * 2 NW +
 * chunk (chunk: 4 columns), swizzled (the low 3 bits xor (row / 4) & 7, a
 * permutation inside each aligned group of 8 slots, which never spans more
 * than one value of row / 4) so that a warp's reads of 8 rows 4 apart hit 8
 * different bank groups; [V, K]: s = column * K / 4 + row / 4, as is. */
template <int VK>
static __device__ __forceinline__ int fq_rec_phys(int s, int row)
{
    return VK ? s : s ^ ((row >> 2) & 7);
}

/* The lane's state entries. Lane l = 16 cg + rg of warp w holds columns
 * c0 .. c0 + 3 (c0 = 8 NW grp + 8 w + 4 cg) of the rows
 *     row(i) = 64 (i / 4) + 4 rg + (i % 4),   i = 0 .. RK - 1,
 * as S[i][e] (e: the column). Its RK float4 in memory: [K, V] (kv) float4 f is
 * row(f), columns c0 .. c0 + 3; [V, K] (vk) float4 f is column c0 + f / (K/64),
 * rows 64 (f % (K/64)) + 4 rg .. + 3. Either way a warp's store of one float4
 * number (fq_rec_tile_store) covers whole 32-byte sectors (kv: 16 rows x 32
 * bytes; vk: 2 columns x 256 contiguous bytes). */
template <int K, int VK>
static __device__ __forceinline__ int fq_rec_f4_offset(int f, int V)
{
    /* relative to the lane's first float4: kv 4 rg * V + c0, vk c0 * K + 4 rg */
    if (!VK) return (64 * (f / 4) + (f % 4)) * V;
    constexpr int KH = K / 64;
    return (f / KH) * K + 64 * (f % KH);
}

/* The lane's first float4 in a state [K, V] or [V, K] at base. */
template <int K, int VK>
static __device__ __forceinline__ int fq_rec_lane_offset(int rg, int c0, int V)
{
    return VK ? c0 * K + 4 * rg : 4 * rg * V + c0;
}

template <int K, int VK>
static __device__ __forceinline__ void fq_rec_f4_to_S(float S[K / 16][4], int f, float4 x)
{
    if (!VK) {
        S[f][0] = x.x; S[f][1] = x.y; S[f][2] = x.z; S[f][3] = x.w;
    } else {
        constexpr int KH = K / 64;
        const int e = f / KH, i = 4 * (f % KH);
        S[i][e] = x.x; S[i + 1][e] = x.y; S[i + 2][e] = x.z; S[i + 3][e] = x.w;
    }
}

template <int K, int VK>
static __device__ __forceinline__ float4 fq_rec_S_to_f4(const float S[K / 16][4], int f)
{
    if (!VK) return make_float4(S[f][0], S[f][1], S[f][2], S[f][3]);
    constexpr int KH = K / 64;
    const int e = f / KH, i = 4 * (f % KH);
    return make_float4(S[i][e], S[i + 1][e], S[i + 2][e], S[i + 3][e]);
}

template <int K, int VK>
static __device__ __forceinline__ void fq_rec_tile_store(const float S[K / 16][4], float *base, int rg, int c0, int V)
{
    base += fq_rec_lane_offset<K, VK>(rg, c0, V);
#pragma unroll
    for (int f = 0; f < K / 16; f++) *(float4 *)(base + fq_rec_f4_offset<K, VK>(f, V)) = fq_rec_S_to_f4<K, VK>(S, f);
}

/* cp.async of the block item's state tile (head: the value head's state,
 * colbase: its first column) into a stage; lw = log2(2 NW), tid: the thread
 * in the block. Each thread copies RK slots. */
template <int K, int VK>
static __device__ __forceinline__ void fq_rec_tile_copy(unsigned char *stage, const float *head, int colbase, int lw,
                                                        int V, int tid)
{
    const int nth = 16 << lw; /* 32 NW threads */
#pragma unroll
    for (int p = 0; p < K / 16; p++) {
        const int s = p * nth + tid;
        if (!VK) {
            const int row = s >> lw, ch = s & ((1 << lw) - 1);
            fq_cp_async16(stage + 16 * fq_rec_phys<0>(s, row), head + row * V + colbase + 4 * ch, 16);
        } else {
            fq_cp_async16(stage + 16 * s, head + colbase * K + 4 * s, 16);
        }
    }
}

/* The lane's RK float4 of the tile from a stage (warp wib of the block). */
template <int K, int VK>
static __device__ __forceinline__ void fq_rec_tile_read(float S[K / 16][4], const unsigned char *stage, int lw, int wib,
                                                        int rg, int cg)
{
#pragma unroll
    for (int f = 0; f < K / 16; f++) {
        int phys;
        if (!VK) {
            const int row = 64 * (f / 4) + 4 * rg + (f % 4);
            phys = fq_rec_phys<0>((row << lw) + 2 * wib + cg, row);
        } else {
            constexpr int KH = K / 64;
            phys = (8 * wib + 4 * cg + f / KH) * (K / 4) + 16 * (f % KH) + rg;
        }
        fq_rec_f4_to_S<K, VK>(S, f, *(const float4 *)(stage + 16 * phys));
    }
}

/* cp.async of tokens row0 .. row0 + n - 1 (n <= NPF) into the token part of a
 * stage, the block's threads sharing the 16-byte pieces. */
template <int K, int NPF, int ES>
static __device__ __forceinline__ void fq_rec_tok_copy(unsigned char *stage, const fq_rec_args &a, int64_t row0,
                                                       int n, int hq, int j, int colbase, int nw, int tid)
{
    typedef fq_rec_stage<K, NPF, ES> SG;
    constexpr int QC = SG::qk_bytes / 16;
    const int TC = SG::tok_bytes(nw) / 16;
    unsigned char *dst = stage + SG::state_bytes(nw);
    for (int c = tid; c < n * TC; c += 32 * nw) {
        const int t = c / TC, w = c % TC;
        const int64_t row = row0 + t;
        const unsigned char *src;
        if (w < QC) src = (const unsigned char *)a.q + (row * a.H + hq) * (int64_t)SG::qk_bytes + 16 * w;
        else if (w < 2 * QC) src = (const unsigned char *)a.k + (row * a.H + hq) * (int64_t)SG::qk_bytes + 16 * (w - QC);
        else src = (const unsigned char *)a.v + ((row * a.HV + j) * a.V + colbase) * (int64_t)ES + 16 * (w - 2 * QC);
        fq_cp_async16(dst + t * SG::tok_bytes(nw) + 16 * w, src, 16);
    }
}

/* 4 elements of ES bytes at a stage address -> float */
template <int ES>
static __device__ __forceinline__ void fq_rec_ld4(const unsigned char *s, fq_dtype dt, float out[4])
{
    if constexpr (ES == 4) {
        const float4 x = *(const float4 *)s;
        out[0] = x.x; out[1] = x.y; out[2] = x.z; out[3] = x.w;
    } else {
        const uint2 x = *(const uint2 *)s;
        const uint32_t w[2] = {x.x, x.y};
#pragma unroll
        for (int h = 0; h < 4; h++) {
            const unsigned short b = (unsigned short)(w[h >> 1] >> (16 * (h & 1)));
            out[h] = dt == FQ_BF16 ? __uint_as_float((uint32_t)b << 16) : __half2float(__ushort_as_half(b));
        }
    }
}

/* A block item: (sequence n, value head j, column group grp of 8 NW
 * columns); ngrp = V / (8 NW) groups per head, items < 2^30 (checked on the
 * host). Its index loads (cu_seqlens, state_indices) are
 * issued two items ahead and resolved one item ahead, so that no load is
 * waited for where it is issued. */
struct fq_rec_item {
    int it;
    int64_t c0raw, c1raw, slotraw;
};

static __device__ __forceinline__ void fq_rec_item_load(fq_rec_item &d, const fq_rec_args &a, int it, int items, int ngrp)
{
    d.it = it;
    d.c0raw = d.c1raw = d.slotraw = 0;
    if (it >= items) return;
    const int n = it / (ngrp * a.HV);
    if (a.cu) {
        d.c0raw = fq_ld_index(a.cu, a.cu_is64, n);
        d.c1raw = fq_ld_index(a.cu, a.cu_is64, n + 1);
    }
    d.slotraw = a.idx ? fq_ld_index(a.idx, a.idx_is64, n) : n;
}

/* Resolved: bounds clamped to [0, T] (invalid offsets never read out of
 * bounds), the slot (valid only with has_state: 0 <= slot < P, P < 2^31),
 * and whether the state tile is read at all. */
struct fq_rec_where {
    int64_t bos;
    int n, len, slot, j, grp, hq, has_state;
};

static __device__ __forceinline__ fq_rec_where fq_rec_resolve(const fq_rec_item &d, const fq_rec_args &a, int ngrp)
{
    fq_rec_where w;
    w.n = d.it / (ngrp * a.HV);
    w.j = (d.it / ngrp) % a.HV;
    w.grp = d.it % ngrp;
    w.hq = w.j / (a.HV / a.H);
    int64_t len;
    if (a.cu) {
        int64_t b0 = d.c0raw, b1 = d.c1raw;
        b0 = b0 < 0 ? 0 : (b0 > a.T ? a.T : b0);
        b1 = b1 < b0 ? b0 : (b1 > a.T ? a.T : b1);
        w.bos = b0;
        len = b1 - b0;
    } else {
        w.bos = (int64_t)w.n * a.T;
        len = a.T;
    }
    w.len = (int)len; /* T < 2^31 (checked on the host) */
    w.has_state = d.slotraw >= 0 && d.slotraw < a.P && len > 0;
    w.slot = w.has_state ? (int)d.slotraw : 0;
    return w;
}

/* The raw gates of an item's first NPF tokens (and its fused-gate
 * parameters), loaded one item ahead through the read-only path. */
template <int NPF> struct fq_rec_gates {
    float g[NPF], b[NPF], A_log, dtb;
};

template <int NPF>
static __device__ __forceinline__ void fq_rec_gates_load(fq_rec_gates<NPF> &x, const fq_rec_args &a, const fq_rec_where &w,
                                                         int t0)
{
#pragma unroll
    for (int i = 0; i < NPF; i++) {
        const int64_t gi = (w.bos + t0 + i) * a.HV + w.j;
        const int ok = t0 + i < w.len;
        x.g[i] = ok ? fq_ldg_f(a.g, a.gate_dtype, gi) : 0.f;
        x.b[i] = ok ? fq_ldg_f(a.beta, a.gate_dtype, gi) : 0.f;
    }
    x.A_log = a.A_log ? __ldg(a.A_log + w.j) : 0.f;
    x.dtb = a.dt_bias ? __ldg(a.dt_bias + w.j) : 0.f;
}

/* A slot an earlier sequence names too belongs to that one (issue 9): scan
 * state_indices[0 .. n) (loads in flight together, no early exit). */
static __device__ __forceinline__ int fq_rec_is_dup(const fq_rec_args &a, const fq_rec_where &w, int lane)
{
    if (!a.idx || !w.has_state) return 0;
    int dup = 0;
#pragma unroll 4
    for (int m = lane; m < w.n; m += 32) dup |= fq_ld_index(a.idx, a.idx_is64, m) == (int64_t)w.slot;
    return __any_sync(0xffffffffu, dup);
}

#define FQ_REC_RED 11 /* S^T k (4), S^T q (4), k.q, |k|^2, |q|^2 */

/* Resident blocks of 4 warps per SM asked of the compiler (the state in
 * flight is what bounds decode: 16 KB per block, prefetched one item ahead).
 * T = 1: 5 (96 registers, no spill; 34 KB of stages per block at bf16);
 * groups of 4 tokens: 4 (128 registers, no spill; 37 KB of stages at bf16,
 * 41 KB at fp32). K = 256 (issue 7 item 4): the lane holds 16 float4 of
 * state (64 registers) and 16 + 16 of q, k; 2 blocks (stages of 66-83 KB
 * per block, 32 KB of state each). */
template <int K, int NPF, int ES, int VK>
__global__ void __launch_bounds__(128, (K > 128 ? 2 : (NPF == 1 ? 5 : 4))) fq_recurrent_kernel(fq_rec_args a)
{
    typedef fq_rec_stage<K, NPF, ES> SG;
    constexpr int RK = K / 16;
    extern __shared__ __align__(16) unsigned char fq_rec_smem[];
    const int tid = threadIdx.x, lane = tid & 31, wib = tid >> 5, nw = blockDim.x >> 5;
    const int lw = nw == 4 ? 3 : nw; /* log2(2 NW) */
    const int G = gridDim.x, w0 = blockIdx.x;
    const int sbytes = SG::bytes(nw); /* stage b at fq_rec_smem + b * sbytes */
    const int HV = a.HV, V = a.V, ngrp = V / (8 * nw);
    const int items = (int)a.N * HV * ngrp;
    const int rg = lane & 15, cg = lane >> 4;

    /* programmatic dependent launch: nothing is read before the kernel
     * before this one is complete (the cu_seqlens check, or the caller's) */
    fq_pdl_wait();
    fq_pdl_trigger();
    if (a.flags && a.flags[0]) {
        /* invalid cu_seqlens: o <- NaN (grid-stride), nothing else written */
        const int64_t total = a.T * HV * V, nth = (int64_t)gridDim.x * blockDim.x;
        const float nan = __int_as_float(0x7fc00000);
        for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += nth)
            fq_st_f(a.o, a.dtype, i, nan);
        return;
    }

    /* prologue: block item w0 resolved and its stage issued; item w0 + G's
     * index loads in flight */
    fq_rec_item dn;
    fq_rec_item_load(dn, a, w0, items, ngrp);
    fq_rec_where cur = fq_rec_resolve(dn, a, ngrp);
    fq_rec_item_load(dn, a, w0 + G, items, ngrp);
    fq_rec_gates<NPF> gc = {};
    int dup = 0;
    if (w0 < items) { /* (always so: the grid is at most the block items) */
        if (cur.has_state)
            fq_rec_tile_copy<K, VK>(fq_rec_smem, a.state + ((int64_t)cur.slot * HV + cur.j) * (K * V), 8 * nw * cur.grp,
                                    lw, V, tid);
        fq_rec_tok_copy<K, NPF, ES>(fq_rec_smem, a, cur.bos, min(NPF, cur.len), cur.hq, cur.j, 8 * nw * cur.grp, nw, tid);
        fq_rec_gates_load<NPF>(gc, a, cur, 0);
        dup = fq_rec_is_dup(a, cur, lane);
    }
    fq_cp_async_commit();

    int b = 0;
    for (int it = w0; it < items; it += G, b ^= 1) {
        /* this item's stage landed (every thread waits for its own copies,
         * the barrier makes all of them visible), and every warp is done
         * with the other stage (the item before) */
        fq_cp_async_wait<0>();
        __syncthreads();
        /* the next item: resolved (its index loads were issued an item ago),
         * its stage issued, its gates and the index loads of the one after */
        const fq_rec_where nx = fq_rec_resolve(dn, a, ngrp);
        const int has_next = it + G < items;
        fq_rec_item_load(dn, a, it + 2 * G, items, ngrp);
        unsigned char *const nst = fq_rec_smem + (b ^ 1) * sbytes;
        if (has_next) {
            if (nx.has_state)
                fq_rec_tile_copy<K, VK>(nst, a.state + ((int64_t)nx.slot * HV + nx.j) * (K * V), 8 * nw * nx.grp, lw, V,
                                        tid);
            fq_rec_tok_copy<K, NPF, ES>(nst, a, nx.bos, min(NPF, nx.len), nx.hq, nx.j, 8 * nw * nx.grp, nw, tid);
        }
        fq_cp_async_commit();
        fq_rec_gates<NPF> gn = gc;
        if (has_next) fq_rec_gates_load<NPF>(gn, a, nx, 0);

        /* this item: warp wib's 8 columns of the group */
        unsigned char *st = fq_rec_smem + b * sbytes;
        const int c0 = 8 * nw * cur.grp + 8 * wib + 4 * cg;
        if (!cur.has_state || dup) {
            /* padding (slot < 0 or >= P): o rows 0, the pool untouched; a
             * duplicated slot: o rows NaN, nothing written */
            if (rg == 0 && cur.len > 0) {
                const float x = dup ? __int_as_float(0x7fc00000) : 0.f;
                for (int t = 0; t < cur.len; t++) {
                    const int64_t ob = ((cur.bos + t) * HV + cur.j) * V + c0;
                    fq_st_f2(a.o, a.dtype, ob, x, x);
                    fq_st_f2(a.o, a.dtype, ob + 2, x, x);
                }
            }
        } else {
            float S[RK][4];
            fq_rec_tile_read<K, VK>(S, st, lw, wib, rg, cg);
            /* NPF = 1 serves T = 1 without cu_seqlens only: len is 1 there */
            const int len = NPF == 1 ? 1 : cur.len;
            for (int t0 = 0; t0 < len; t0 += NPF) {
                if (NPF > 1 && t0 > 0) {
                    /* tokens past the first group (T > NPF): copied into this
                     * stage once every warp is done with the group before,
                     * and waited for here (block-uniform: one item per block) */
                    __syncthreads();
                    fq_rec_tok_copy<K, NPF, ES>(st, a, cur.bos + t0, min(NPF, cur.len - t0), cur.hq, cur.j,
                                                8 * nw * cur.grp, nw, tid);
                    fq_cp_async_commit();
                    fq_rec_gates_load<NPF>(gc, a, cur, t0);
                    fq_cp_async_wait<0>();
                    __syncthreads();
                }
#pragma unroll
                for (int i = 0; i < NPF; i++) {
                    const int t = t0 + i;
                    if (t >= len) break;
                    const unsigned char *tk = st + SG::state_bytes(nw) + i * SG::tok_bytes(nw);
                    float qv[RK], kv[RK], vv[4];
#pragma unroll
                    for (int h = 0; h < RK / 4; h++) {
                        fq_rec_ld4<ES>(tk + (64 * h + 4 * rg) * ES, a.dtype, qv + 4 * h);
                        fq_rec_ld4<ES>(tk + SG::qk_bytes + (64 * h + 4 * rg) * ES, a.dtype, kv + 4 * h);
                    }
                    fq_rec_ld4<ES>(tk + 2 * SG::qk_bytes + (8 * wib + 4 * cg) * ES, a.dtype, vv);
                    /* fused gates: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) */
                    float g = gc.g[i];
                    if (a.A_log) {
                        const float xg = g + gc.dtb;
                        g = -__expf(gc.A_log) * (xg > 20.f ? xg : log1pf(__expf(xg)));
                    }
                    const float bt = a.beta_sigmoid ? 1.f / (1.f + __expf(-gc.b[i])) : gc.b[i];

                    /* partial sums over the lane's rows; then over the 16 row
                     * groups (lane bits 0..3): every lane gets the totals */
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
#pragma unroll
                    for (int m = 1; m < 16; m <<= 1)
#pragma unroll
                        for (int e = 0; e < FQ_REC_RED; e++) part[e] += __shfl_xor_sync(0xffffffffu, part[e], m);

                    float rq = 1.f, rk = 1.f;
                    if (a.l2norm) {
                        rk = rsqrtf(part[9] + 1e-6f);
                        rq = rsqrtf(part[10] + 1e-6f);
                    }
                    const float alpha = __expf(g);
                    const float kq = part[8] * rk * rq;
                    float u[4], ov[4];
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        u[e] = bt * (vv[e] - alpha * rk * part[e]);
                        ov[e] = a.scale * (alpha * rq * part[4 + e] + u[e] * kq);
                    }
                    if (rg == 0) {
                        const int64_t ob = ((cur.bos + t) * HV + cur.j) * V + c0;
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
                        fq_rec_tile_store<K, VK>(S, a.inter + (((int64_t)cur.n * a.Ti + t) * HV + cur.j) * (K * V), rg, c0, V);
                }
            }
            if (a.update) fq_rec_tile_store<K, VK>(S, a.state + ((int64_t)cur.slot * HV + cur.j) * (K * V), rg, c0, V);
        }
        dup = has_next ? fq_rec_is_dup(a, nx, lane) : 0;
        cur = nx;
        gc = gn;
    }
    fq_cp_async_wait<0>();
}

/* One block: flags[0] = 1 when cu_seqlens does not start at 0, decreases,
 * does not end at T, or (Ti > 0) holds a sequence longer than Ti. */
__global__ void fq_rec_validate_kernel(const void *cu, int is64, int64_t N, int64_t T, int64_t Ti, int *flags)
{
    __shared__ int bad;
    if (threadIdx.x == 0) bad = 0;
    __syncthreads();
    for (int64_t i = threadIdx.x; i <= N; i += blockDim.x) {
        int64_t c = fq_ld_index(cu, is64, i);
        int b = c < 0 || c > T || (i == 0 && c != 0) || (i == N && c != T);
        if (i > 0) {
            const int64_t prev = fq_ld_index(cu, is64, i - 1);
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

/* SMs of the current device, cached per device (the call stays free of
 * attribute queries after the first). */
static int fq_rec_sm_count(int dev)
{
    static int cache[64];
    if (dev < 0 || dev >= 64) return 132;
    if (cache[dev] <= 0) {
        int sms = 0;
        if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms <= 0) {
            (void)cudaGetLastError();
            return 132;
        }
        cache[dev] = sms;
    }
    return cache[dev];
}

/* One kernel: nw warps per block, two stages per block; the grid is at most
 * what is resident at once (each block then walks block items b, b + G,
 * ...), so every block prefetches its next item while it computes one.
 * Resident blocks per SM and the shared-memory opt-in (for the largest
 * stages, nw = 4) are settled once per kernel and device. */
template <int K, int NPF, int ES, int VK>
static fq_status fq_rec_launch(const fq_rec_args &a, int64_t cols8, int nw, int dev, int sms, cudaStream_t stream)
{
    typedef fq_rec_stage<K, NPF, ES> SG;
    void (*kern)(fq_rec_args) = fq_recurrent_kernel<K, NPF, ES, VK>;
    const size_t smem = (size_t)2 * SG::bytes(nw);
    static int resident[64][3]; /* [device][nw = 1, 2, 4] blocks per SM, 0: not yet asked */
    const int slot = nw == 4 ? 2 : nw - 1;
    int per_sm = dev >= 0 && dev < 64 ? resident[dev][slot] : 0;
    if (per_sm <= 0) {
        FQ_CUDA_CHECK(cudaFuncSetAttribute((const void *)kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           2 * SG::bytes(4)));
        FQ_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, 32 * nw, smem));
        if (per_sm <= 0) per_sm = 1;
        if (dev >= 0 && dev < 64) resident[dev][slot] = per_sm;
    }
    int64_t blocks = cols8 / nw; /* block items: cols8 is a multiple of 8 */
    if (blocks > (int64_t)per_sm * sms) blocks = (int64_t)per_sm * sms;
    return fq_launch_k(kern, (unsigned)blocks, 32u * (unsigned)nw, smem, stream, fq_cuda_pdl_enabled(), a);
}

template <int K, int NPF>
static fq_status fq_rec_launch_dt(const fq_rec_args &a, int64_t items, int nw, int dev, int sms, cudaStream_t stream)
{
    if (a.dtype == FQ_F32)
        return a.vk ? fq_rec_launch<K, NPF, 4, 1>(a, items, nw, dev, sms, stream)
                    : fq_rec_launch<K, NPF, 4, 0>(a, items, nw, dev, sms, stream);
    return a.vk ? fq_rec_launch<K, NPF, 2, 1>(a, items, nw, dev, sms, stream)
                : fq_rec_launch<K, NPF, 2, 0>(a, items, nw, dev, sms, stream);
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
    const int64_t items = p->N * p->HV * (p->V / 8);
    if (items <= 0) return FQ_OK;
    if (items > INT32_MAX / 2 || p->T > INT32_MAX || p->P > INT32_MAX)
        return fq_fail(FQ_ERR_VALUE, "the CUDA recurrent step takes fewer than 2^30 (sequence, value head, 8 "
                                     "columns) items and fewer than 2^31 tokens and pool slots");
    int dev = 0;
    FQ_CUDA_CHECK(cudaGetDevice(&dev));
    const int sms = fq_rec_sm_count(dev);
    /* blocks of 4 warps (32 columns: [K, V] rows read 128 bytes at a time)
     * unless that leaves SMs without a block (N = 1, HV = 32: 256 blocks of
     * 2 warps); V / 8 is 8, 16 or 32, so items is a multiple of every choice */
    int nw = 4;
    while (nw > 1 && items / nw < (int64_t)sms) nw /= 2;
    /* T = 1 (without cu_seqlens, the decode step): one token per stage;
     * otherwise groups of 4 */
    const int one = !p->cu_seqlens && p->T <= 1;
    if (p->K == 128) return one ? fq_rec_launch_dt<128, 1>(a, items, nw, dev, sms, stream)
                                : fq_rec_launch_dt<128, 4>(a, items, nw, dev, sms, stream);
    if (p->K == 256) return one ? fq_rec_launch_dt<256, 1>(a, items, nw, dev, sms, stream) /* issue 7 item 4 */
                                : fq_rec_launch_dt<256, 4>(a, items, nw, dev, sms, stream);
    return one ? fq_rec_launch_dt<64, 1>(a, items, nw, dev, sms, stream)
               : fq_rec_launch_dt<64, 4>(a, items, nw, dev, sms, stream);
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
