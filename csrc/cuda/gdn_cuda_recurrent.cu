/*
 * gdn_cuda_recurrent.cu — the recurrent step (decode / multi-token verify):
 * the operator of DESIGN §1 token by token on a state pool.
 *
 *     alpha_t = e^{g_t}
 *     u_t     = beta_t (v_t - alpha_t S^T k_t)
 *     o_t     = scale S_t^T q_t = scale (alpha_t S^T q_t + u_t (k_t . q_t))
 *     S      <- alpha_t S + k_t u_t^T
 *
 * Two kernels, one item = (sequence n, value head j, 32 state columns) per
 * block of 128 threads at a time; the item's state tile (K x 32 fp32) is
 * read once and written back once, every warp instruction covering whole
 * 128-byte lines (the lane maps below; decode is bound by how well the pool
 * streams through DRAM):
 *
 *   fq_recurrent_kernel (persistent): the grid is what is resident at once
 *     (4 blocks per SM) and block b walks items b, b + G, ...: while it
 *     computes one, the next one's tile is on its way into its other
 *     shared-memory stage (cp.async, each thread its own pieces, so no block
 *     barrier guards a stage) and the index loads of the one after that are
 *     in flight;
 *   fq_decode_kernel (one token per sequence, no cu_seqlens): one block per
 *     item, the tile straight from the pool into registers, no item loop —
 *     where one wave holds every item (one sequence: latency) and on a
 *     [K, V] pool with many items per resident block (the launcher says
 *     why).
 *
 * Per token (fq_rec_token, both kernels):
 *
 *     partial sums over the thread's elements of S^T k, S^T q (its columns)
 *     and of k.q, |k|^2, |q|^2 (for use_qk_l2norm: q = rq q_raw, k = rk
 *     k_raw) -> totals over K ([K, V]: lanes, then the 4 warps through
 *     shared memory; [V, K]: a transposing reduction over the lanes) ->
 *     u and o for the thread's columns, the update of its elements.
 *
 * The persistent kernel loads the next token's inputs (q, k, v, gates; the
 * next item's first token after an item's last) while one computes. Both
 * are launched with programmatic dependent launch: the blocks of a decode
 * step are resident while the step before finishes, and wait for it
 * (griddepcontrol.wait) before their first load.
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
 * prefetch, commit d791258; per-warp stages, commit c6a0c89; blocks of 1-4
 * warps walking items with a two-stage cp.async ring and a lane map of
 * 32-byte row pieces, commit a059362) are in git history and
 * benchmarks/NOTES.md (session 18: why the lane map matters).
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
    int lg_nsl; /* log2(V / 32): the decode kernel's grid */
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

/* N consecutive elements (N = 2, 4, 8 or 16; N ES bytes aligned to min(16,
 * N ES)) of q, k or v at p as raw words (4- to 16-byte loads), and the words
 * -> float: the inputs of the next token wait in registers packed. */
template <int N, int ES>
static __device__ __forceinline__ void fq_rec_ldw(const unsigned char *p, uint32_t (&w)[N * ES / 4])
{
    if constexpr (N * ES == 4) w[0] = *(const uint32_t *)p;
    else if constexpr (N * ES == 8) { const uint2 x = *(const uint2 *)p; w[0] = x.x; w[1] = x.y; }
    else {
#pragma unroll
        for (int h = 0; h < N * ES / 16; h++) {
            const uint4 x = ((const uint4 *)p)[h];
            w[4 * h] = x.x; w[4 * h + 1] = x.y; w[4 * h + 2] = x.z; w[4 * h + 3] = x.w;
        }
    }
}
template <int N, int ES>
static __device__ __forceinline__ void fq_rec_unpack(const uint32_t *w, fq_dtype dt, float (&out)[N])
{
#pragma unroll
    for (int h = 0; h < N; h++) {
        if constexpr (ES == 4) {
            out[h] = __uint_as_float(w[h]);
        } else {
            const unsigned short b = (unsigned short)(w[h >> 1] >> (16 * (h & 1)));
            out[h] = dt == FQ_BF16 ? __uint_as_float((uint32_t)b << 16) : __half2float(__ushort_as_half(b));
        }
    }
}

/* --------------------------------------------------------- lane maps ----
 *
 * A block of 128 threads takes one item: (sequence n, value head j, 32
 * state columns c0 .. c0 + 31, c0 = 32 sl). Its state tile is K rows x 128
 * bytes of a [K, V] state or 32 rows of K contiguous floats of a [V, K] one;
 * every warp instruction that reads or writes it covers whole 128-byte lines
 * (dev/cuda/bench_decode_stream.cu: a map of 32-byte pieces of 16 rows per
 * instruction reached 2.0 TB/s on the H100 where this one reaches 2.65-2.8,
 * memcpy's 2.85-2.95).
 *
 * [K, V] (kv): thread t holds columns c0 + 4 (t % 8) .. + 3 of the RK = K / 16
 * consecutive rows RK (t / 8) .. as S[e][i] (column c0 + 4 (t % 8) + e, row
 * RK (t / 8) + i); a warp instruction i covers rows RK (4 w + 0..3) + i,
 * 128 bytes each. S^T k over the rows: the thread's rows, lanes xor 8 and 16
 * (the warp's 4 row groups), then the 4 warps through shared memory.
 *
 * [V, K] (vk): warp w holds the tile's rows (state columns) c0 + 8 w + i,
 * i < 8; lane l the elements k = KL l + 128 h + e (KL = min(K, 128) / 32
 * consecutive elements per 128-element half, h < K / 128) as S[i][KL h + e]:
 * a warp instruction covers one row's 512 (K = 128) contiguous bytes. S^T k
 * along the row: a transposing reduction over the warp's lanes (no shared
 * memory, no block barrier). */
template <int K> struct fq_rec_vk_map {
    static constexpr int KL = (K < 128 ? K : 128) / 32; /* consecutive k per lane and half */
    static constexpr int NH = K > 128 ? K / 128 : 1;    /* halves */
    static constexpr int KE = KL * NH;                  /* k elements per lane */
};

/* The thread's state elements of one head's state at base (pool slot or
 * intermediate state), in the maps above: NP pieces of PB bytes per thread
 * (kv: the RK rows' float4; vk: per row and half the KL floats). A stage
 * keeps piece i of thread t at (128 i + t) PB: each thread copies its own
 * pieces in (cp.async) and reads only those back, so no block barrier
 * guards a stage. */
template <int K, int VK> struct fq_rec_pieces {
    static constexpr int NP = VK ? 8 * fq_rec_vk_map<K>::NH : K / 16;
    static constexpr int PB = VK ? 4 * fq_rec_vk_map<K>::KL : 16;
    static constexpr int stage_bytes = 128 * NP * PB;
};

/* piece i of thread t: its offset in floats from the head's state */
template <int K, int VK>
static __device__ __forceinline__ int fq_rec_piece_at(int i, int V, int c0, int t)
{
    if (!VK) return (K / 16 * (t >> 3) + i) * V + c0 + 4 * (t & 7);
    typedef fq_rec_vk_map<K> M;
    return (c0 + 8 * (t >> 5) + i / M::NH) * K + 128 * (i % M::NH) + M::KL * (t & 31);
}

template <int K, int VK>
static __device__ __forceinline__ void fq_rec_tile_copy(unsigned char *stage, const float *base, int V, int c0, int t)
{
    typedef fq_rec_pieces<K, VK> P;
#pragma unroll
    for (int i = 0; i < P::NP; i++) {
        unsigned char *d = stage + (128 * i + t) * P::PB;
        const float *src = base + fq_rec_piece_at<K, VK>(i, V, c0, t);
        if constexpr (P::PB == 16) fq_cp_async16(d, src, 16);
        else fq_cp_async8(d, src);
    }
}

/* Piece i of the thread's state elements from src (a stage or the pool) */
template <int K, int VK>
static __device__ __forceinline__ void fq_rec_piece_in(float (&S)[8][K / 16], int i, const float *src)
{
    if (!VK) {
        const float4 x = *(const float4 *)src;
        S[0][i] = x.x; S[1][i] = x.y; S[2][i] = x.z; S[3][i] = x.w;
    } else {
        typedef fq_rec_vk_map<K> M;
        const int r = i / M::NH, e0 = M::KL * (i % M::NH);
        if constexpr (M::KL == 2) {
            const float2 x = *(const float2 *)src;
            S[r][e0] = x.x; S[r][e0 + 1] = x.y;
        } else {
            const float4 x = *(const float4 *)src;
            S[r][e0] = x.x; S[r][e0 + 1] = x.y; S[r][e0 + 2] = x.z; S[r][e0 + 3] = x.w;
        }
    }
}

/* The thread's pieces from a stage (the persistent kernel) */
template <int K, int VK>
static __device__ __forceinline__ void fq_rec_tile_read(float (&S)[8][K / 16], const unsigned char *stage, int t)
{
    typedef fq_rec_pieces<K, VK> P;
#pragma unroll
    for (int i = 0; i < P::NP; i++) fq_rec_piece_in<K, VK>(S, i, (const float *)(stage + (128 * i + t) * P::PB));
}

/* The same pieces straight from the pool into registers (the decode kernel: no stage) */
template <int K, int VK>
static __device__ __forceinline__ void fq_rec_tile_ld(float (&S)[8][K / 16], const float *base, int V, int c0, int t)
{
    typedef fq_rec_pieces<K, VK> P;
#pragma unroll
    for (int i = 0; i < P::NP; i++) fq_rec_piece_in<K, VK>(S, i, base + fq_rec_piece_at<K, VK>(i, V, c0, t));
}

template <int K, int VK>
static __device__ __forceinline__ void fq_rec_tile_st(const float (&S)[8][K / 16], float *base, int V, int c0, int t)
{
    typedef fq_rec_pieces<K, VK> P;
#pragma unroll
    for (int i = 0; i < P::NP; i++) {
        float *d = base + fq_rec_piece_at<K, VK>(i, V, c0, t);
        if (!VK) {
            *(float4 *)d = make_float4(S[0][i], S[1][i], S[2][i], S[3][i]);
        } else {
            typedef fq_rec_vk_map<K> M;
            const int r = i / M::NH, e0 = M::KL * (i % M::NH);
            if constexpr (M::KL == 2) *(float2 *)d = make_float2(S[r][e0], S[r][e0 + 1]);
            else *(float4 *)d = make_float4(S[r][e0], S[r][e0 + 1], S[r][e0 + 2], S[r][e0 + 3]);
        }
    }
}
/* (Both maps keep the thread's state in float S[8][K / 16]: kv as S[e][i]
 * for its 4 columns e and K / 16 rows i (S[4..7] unused: K / 4 floats), vk
 * as S[i][kk] for its 8 rows i and KE elements kk (KE = K / 16 at K >= 128,
 * 2 at K = 64).) */

/* One token's inputs for the thread, raw: its q and k elements (kv: rows
 * RK (t / 8) ..; vk: the lane's k elements), its v elements (kv: its 4
 * columns; vk: the value of row c0 + 8 w + (lane / 2) % 8, as float bits),
 * and the gates. */
template <int K, int ES> struct fq_rec_tok {
    static constexpr int NW = K / 16 * ES / 4; /* words of q (of k) */
    uint32_t q[NW], k[NW], v[ES];
    float g, b;
};

template <int K, int ES, int VK>
static __device__ __forceinline__ void fq_rec_tok_ld(fq_rec_tok<K, ES> &x, const fq_rec_args &a, int64_t row, int hq,
                                                     int j, int c0, int t)
{
    constexpr int NE = K / 16;
    const unsigned char *qr = (const unsigned char *)a.q + (row * a.H + hq) * (int64_t)(K * ES);
    const unsigned char *kr = (const unsigned char *)a.k + (row * a.H + hq) * (int64_t)(K * ES);
    const unsigned char *vr = (const unsigned char *)a.v + (row * a.HV + j) * (int64_t)a.V * ES;
    if (!VK) {
        const int r0 = NE * (t >> 3);
        fq_rec_ldw<NE, ES>(qr + r0 * ES, x.q);
        fq_rec_ldw<NE, ES>(kr + r0 * ES, x.k);
        fq_rec_ldw<4, ES>(vr + (c0 + 4 * (t & 7)) * ES, x.v);
    } else {
        typedef fq_rec_vk_map<K> M;
        constexpr int HW = M::KL * ES / 4; /* words per half */
        const int l = t & 31;
#pragma unroll
        for (int h = 0; h < M::NH; h++) {
            uint32_t qq[HW], kk[HW];
            fq_rec_ldw<M::KL, ES>(qr + (M::KL * l + 128 * h) * ES, qq);
            fq_rec_ldw<M::KL, ES>(kr + (M::KL * l + 128 * h) * ES, kk);
#pragma unroll
            for (int e = 0; e < HW; e++) x.q[HW * h + e] = qq[e], x.k[HW * h + e] = kk[e];
        }
        const int c = c0 + 8 * (t >> 5) + ((l >> 1) & 7);
        x.v[0] = __float_as_uint(fq_ld_f(vr, a.dtype, c));
    }
    const int64_t gi = row * a.HV + j;
    x.g = fq_ldg_f(a.g, a.gate_dtype, gi);
    x.b = fq_ldg_f(a.beta, a.gate_dtype, gi);
}

/* x where the mask m is all ones, else y (bitwise: no indexed access) */
static __device__ __forceinline__ float fq_rec_sel(uint32_t m, float x, float y)
{
    return __uint_as_float((__float_as_uint(x) & m) | (__float_as_uint(y) & ~m));
}

/* One step of the transposing reduction over a warp's lanes: of 2 HALF
 * values the lane keeps HALF (the upper ones where lane bit log2(HALF) + 1
 * is set), adding the partner's (lane xor 2 HALF) same ones. */
template <int HALF> static __device__ __forceinline__ void fq_rec_tred(float (&x)[16], int lane)
{
    const uint32_t hm = 0u - (uint32_t)((lane >> (31 - __clz(2 * HALF))) & 1);
#pragma unroll
    for (int e = 0; e < HALF; e++) {
        const float keep = fq_rec_sel(hm, x[HALF + e], x[e]), send = fq_rec_sel(hm, x[e], x[HALF + e]);
        x[e] = keep + __shfl_xor_sync(0xffffffffu, send, 2 * HALF);
    }
}

#define FQ_REC_RED 12 /* kv: S^T k (4), S^T q (4), k.q, |k|^2, |q|^2, (pad) */

/* An item's index loads (cu_seqlens, state_indices), issued two items
 * ahead and resolved one item ahead, so that no load is waited for where it
 * is issued; items < 2^30 (checked on the host). */
struct fq_rec_item {
    int64_t c0raw, c1raw, slotraw;
};

static __device__ __forceinline__ void fq_rec_item_load(fq_rec_item &d, const fq_rec_args &a, int it, int items,
                                                        int nsl)
{
    d.c0raw = d.c1raw = d.slotraw = 0;
    if (it >= items) return;
    const int n = it / (nsl * a.HV);
    if (a.cu) {
        d.c0raw = fq_ld_index(a.cu, a.cu_is64, n);
        d.c1raw = fq_ld_index(a.cu, a.cu_is64, n + 1);
    }
    d.slotraw = a.idx ? fq_ld_index(a.idx, a.idx_is64, n) : n;
}

/* Resolved: bounds clamped to [0, T] (invalid offsets never read out of
 * bounds), the slot (valid only with has_state: 0 <= slot < P, P < 2^31;
 * the state is read at all only then), the state's offset. An item past the
 * last: nothing (len 0, no state). */
struct fq_rec_where {
    int64_t bos, head;
    int n, j, c0, hq, len, slot, has_state;
};

static __device__ __forceinline__ fq_rec_where fq_rec_resolve(const fq_rec_item &d, const fq_rec_args &a, int it,
                                                              int items, int nsl, int K)
{
    fq_rec_where w;
    w.n = it / (nsl * a.HV);
    w.j = (it / nsl) % a.HV;
    w.c0 = 32 * (it % nsl);
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
    if (it >= items) len = 0;
    w.len = (int)len; /* T < 2^31 (checked on the host) */
    w.has_state = d.slotraw >= 0 && d.slotraw < a.P && len > 0;
    w.slot = w.has_state ? (int)d.slotraw : 0;
    w.head = ((int64_t)w.slot * a.HV + w.j) * (int64_t)K * a.V;
    return w;
}

/* A slot an earlier sequence names too belongs to that one (issue 9): the
 * block's threads compare state_indices[0 .. n) with it, no early exit. The
 * first 256 indices are loaded a whole item before they are compared
 * (fq_rec_dup_load, then fq_rec_dup_test after the item); the rest, for
 * n > 256, at the compare. */
struct fq_rec_dup {
    int64_t x[2];
};

static __device__ __forceinline__ void fq_rec_dup_load(fq_rec_dup &p, const fq_rec_args &a, const fq_rec_where &w,
                                                       int t)
{
    const int on = a.idx && w.has_state;
#pragma unroll
    for (int c = 0; c < 2; c++) p.x[c] = on && t + 128 * c < w.n ? fq_ld_index(a.idx, a.idx_is64, t + 128 * c) : -1;
}

static __device__ __forceinline__ int fq_rec_dup_test(const fq_rec_dup &p, const fq_rec_args &a, const fq_rec_where &w,
                                                      int t)
{
    int dup = 0;
    if (a.idx && w.has_state) {
        dup = p.x[0] == (int64_t)w.slot || p.x[1] == (int64_t)w.slot;
        for (int m = t + 256; m < w.n; m += 128) dup |= fq_ld_index(a.idx, a.idx_is64, m) == (int64_t)w.slot;
    }
    return __syncthreads_or(dup); /* (block-uniform) */
}

/* One token of an item (the equations at the top): the gates, S^T k and
 * S^T q over K (kv: the thread's rows, lanes xor 8 and 16, then the 4 warps
 * through red, a [4][8][FQ_REC_RED] buffer the caller alternates between
 * tokens; vk: the transposing reduction), o for the item's 32 columns at
 * orow + c0, and the update of the thread's state elements S. */
template <int K, int ES, int VK>
static __device__ __forceinline__ void fq_rec_token(float (&S)[8][K / 16], const fq_rec_tok<K, ES> &tok,
                                                    const fq_rec_args &a, float *rb, float A_log, float dtb,
                                                    int64_t orow, int c0, int t)
{
    const int lane = t & 31, w = t >> 5;
    /* fused gates: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) */
    float g = tok.g;
    if (a.A_log) {
        const float xg = g + dtb;
        g = -__expf(A_log) * (xg > 20.f ? xg : log1pf(__expf(xg)));
    }
    const float bt = a.beta_sigmoid ? 1.f / (1.f + __expf(-tok.b)) : tok.b;
    const float alpha = __expf(g);
    /* this token's inputs as float: q, k (kv: K / 16 rows, vk: KE
     * elements), v (kv: 4 columns, vk: one row's) */
    constexpr int NE = VK ? fq_rec_vk_map<K>::KE : K / 16;
    float tq[NE], tkk[NE], tv[4] = {0.f, 0.f, 0.f, 0.f};
    fq_rec_unpack<NE, ES>(tok.q, a.dtype, tq);
    fq_rec_unpack<NE, ES>(tok.k, a.dtype, tkk);
    if (!VK) fq_rec_unpack<4, ES>(tok.v, a.dtype, tv);
    else tv[0] = __uint_as_float(tok.v[0]);
    if constexpr (!VK) {
        constexpr int RK = K / 16;
        /* partial sums over the thread's rows, then over the warp's 4 row
         * groups (lanes xor 8, 16), then over the 4 warps */
        float part[FQ_REC_RED];
#pragma unroll
        for (int e = 0; e < FQ_REC_RED; e++) part[e] = 0.f;
#pragma unroll
        for (int i = 0; i < RK; i++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                part[e] += S[e][i] * tkk[i];
                part[4 + e] += S[e][i] * tq[i];
            }
            part[8] += tkk[i] * tq[i];
            part[9] += tkk[i] * tkk[i];
            part[10] += tq[i] * tq[i];
        }
#pragma unroll
        for (int m = 8; m < 32; m <<= 1)
#pragma unroll
            for (int e = 0; e < 11; e++) part[e] += __shfl_xor_sync(0xffffffffu, part[e], m);
        if (lane < 8) {
            float4 *dst = (float4 *)(rb + (w * 8 + lane) * FQ_REC_RED);
            dst[0] = make_float4(part[0], part[1], part[2], part[3]);
            dst[1] = make_float4(part[4], part[5], part[6], part[7]);
            dst[2] = make_float4(part[8], part[9], part[10], 0.f);
        }
        __syncthreads(); /* (one per token: red is double-buffered by token parity) */
        float tot[FQ_REC_RED];
#pragma unroll
        for (int e = 0; e < FQ_REC_RED; e++) tot[e] = 0.f;
#pragma unroll
        for (int ww = 0; ww < 4; ww++) {
            const float4 *s4 = (const float4 *)(rb + (ww * 8 + (t & 7)) * FQ_REC_RED);
#pragma unroll
            for (int h = 0; h < 3; h++) {
                const float4 x = s4[h];
                tot[4 * h] += x.x; tot[4 * h + 1] += x.y; tot[4 * h + 2] += x.z; tot[4 * h + 3] += x.w;
            }
        }
        float rq = 1.f, rk = 1.f;
        if (a.l2norm) {
            rk = rsqrtf(tot[9] + 1e-6f);
            rq = rsqrtf(tot[10] + 1e-6f);
        }
        const float kq = tot[8] * rk * rq;
        float u[4], ov[4];
#pragma unroll
        for (int e = 0; e < 4; e++) {
            u[e] = bt * (tv[e] - alpha * rk * tot[e]);
            ov[e] = a.scale * (alpha * rq * tot[4 + e] + u[e] * kq);
        }
        if (t < 8) {
            fq_st_f2(a.o, a.dtype, orow + c0 + 4 * t, ov[0], ov[1]);
            fq_st_f2(a.o, a.dtype, orow + c0 + 4 * t + 2, ov[2], ov[3]);
        }
#pragma unroll
        for (int i = 0; i < RK; i++) {
            const float kn = rk * tkk[i];
#pragma unroll
            for (int e = 0; e < 4; e++) S[e][i] = alpha * S[e][i] + kn * u[e];
        }
    } else {
        typedef fq_rec_vk_map<K> M;
        /* partial sums over the lane's elements: x[i] = S^T k, x[8 + i] =
         * S^T q of the warp's row i; then a transposing reduction over the
         * 32 lanes (halving the values at each of lane bits 4, 3, 2, 1,
         * then adding lane bit 0): lane l ends with the total of value
         * l / 2, i.e. S^T k of row (l / 2) for l < 16, S^T q of row
         * (l - 16) / 2 above */
        float x[16], sc[3] = {0.f, 0.f, 0.f};
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float pk = 0.f, pq = 0.f;
#pragma unroll
            for (int e = 0; e < M::KE; e++) {
                pk += S[i][e] * tkk[e];
                pq += S[i][e] * tq[e];
            }
            x[i] = pk;
            x[8 + i] = pq;
        }
#pragma unroll
        for (int e = 0; e < M::KE; e++) {
            sc[0] += tkk[e] * tq[e];
            sc[1] += tkk[e] * tkk[e];
            sc[2] += tq[e] * tq[e];
        }
        fq_rec_tred<8>(x, lane);
        fq_rec_tred<4>(x, lane);
        fq_rec_tred<2>(x, lane);
        fq_rec_tred<1>(x, lane);
        const float xt = x[0] + __shfl_xor_sync(0xffffffffu, x[0], 1);
#pragma unroll
        for (int m = 1; m < 32; m <<= 1)
#pragma unroll
            for (int e = 0; e < 3; e++) sc[e] += __shfl_xor_sync(0xffffffffu, sc[e], m);
        float rq = 1.f, rk = 1.f;
        if (a.l2norm) {
            rk = rsqrtf(sc[1] + 1e-6f);
            rq = rsqrtf(sc[2] + 1e-6f);
        }
        const float kq = sc[0] * rk * rq;
        /* lanes l < 16: u of row l / 2 (its v loaded by this lane); lanes
         * 16 + 2 i: o of row i */
        const float uown = bt * (tv[0] - alpha * rk * xt);
        const float ui = __shfl_sync(0xffffffffu, uown, lane & 15);
        if (lane >= 16 && !(lane & 1)) {
            const float ov = a.scale * (alpha * rq * xt + ui * kq);
            fq_st_f(a.o, a.dtype, orow + c0 + 8 * w + ((lane - 16) >> 1), ov);
        }
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const float u = __shfl_sync(0xffffffffu, uown, 2 * i);
#pragma unroll
            for (int e = 0; e < M::KE; e++) S[i][e] = alpha * S[i][e] + rk * tkk[e] * u;
        }
    }
}

/* Resident blocks per SM asked of the compiler: 128 threads, the state in
 * registers (K / 2 floats) and the current and next token's inputs (128
 * registers at K = 128, 8-72 bytes of spill, most outside the token loop; 4
 * blocks measured faster than 3 without spills); two stages of K x 32 fp32
 * (16 KB at K = 128) per block. */
template <int K, int ES, int VK>
__global__ void __launch_bounds__(128, (K > 128 ? 2 : 4)) fq_recurrent_kernel(fq_rec_args a)
{
    typedef fq_rec_pieces<K, VK> PC;
    extern __shared__ __align__(16) unsigned char fq_rec_smem[]; /* stage b at b * PC::stage_bytes */
    __shared__ __align__(16) float red[2][4][8][FQ_REC_RED];    /* kv: [token parity][warp][column group][value] */
    const int t = threadIdx.x;
    const int HV = a.HV, V = a.V, nsl = V / 32;
    const int items = (int)a.N * HV * nsl;
    const int G = gridDim.x;

    /* programmatic dependent launch: nothing is read before the kernel
     * before this one is complete (the cu_seqlens check, or the caller's) */
    fq_pdl_wait();
    fq_pdl_trigger();
    /* the validity flag and the first item's index loads in flight together */
    const int bad = a.flags ? a.flags[0] : 0;
    fq_rec_item d;
    fq_rec_item_load(d, a, blockIdx.x, items, nsl);
    if (bad) {
        /* invalid cu_seqlens: o <- NaN (grid-stride), nothing else written */
        const int64_t total = a.T * HV * V, nth = (int64_t)gridDim.x * blockDim.x;
        const float nan = __int_as_float(0x7fc00000);
        for (int64_t i = (int64_t)blockIdx.x * blockDim.x + t; i < total; i += nth) fq_st_f(a.o, a.dtype, i, nan);
        return;
    }

    /* prologue: the block's first item resolved, its state tile and first
     * token on their way, its duplicate scan done; the next item's index
     * loads in flight */
    fq_rec_where cur = fq_rec_resolve(d, a, blockIdx.x, items, nsl, K);
    fq_rec_item_load(d, a, blockIdx.x + G, items, nsl);
    if (cur.has_state) fq_rec_tile_copy<K, VK>(fq_rec_smem, a.state + cur.head, V, cur.c0, t);
    fq_cp_async_commit();
    fq_rec_tok<K, ES> tok = {};
    if (cur.len > 0) fq_rec_tok_ld<K, ES, VK>(tok, a, cur.bos, cur.hq, cur.j, cur.c0, t);
    fq_rec_dup pd;
    fq_rec_dup_load(pd, a, cur, t);
    int dup = fq_rec_dup_test(pd, a, cur, t);

    int b = 0;
#pragma unroll 1
    for (int it = blockIdx.x; it < items; it += G, b ^= 1) {
        /* the next item: resolved (its index loads were issued an item ago),
         * its state tile into the other stage, its duplicate scan's loads,
         * the index loads of the one after it */
        const fq_rec_where nx = fq_rec_resolve(d, a, it + G, items, nsl, K);
        fq_rec_item_load(d, a, it + 2 * G, items, nsl);
        if (nx.has_state)
            fq_rec_tile_copy<K, VK>(fq_rec_smem + (b ^ 1) * PC::stage_bytes, a.state + nx.head, V, nx.c0, t);
        fq_cp_async_commit();
        fq_rec_dup_load(pd, a, nx, t);
        /* this item's tile (the thread's own pieces: no block barrier) */
        fq_cp_async_wait<1>();
        asm volatile("" ::: "memory");

        if (!cur.has_state || dup) {
            /* padding (slot < 0 or >= P): o rows 0, the pool untouched; a
             * duplicated slot: o rows NaN, nothing written */
            const float x = dup ? __int_as_float(0x7fc00000) : 0.f;
            for (int64_t i = t; i < (int64_t)cur.len * 32; i += 128)
                fq_st_f(a.o, a.dtype, ((cur.bos + i / 32) * HV + cur.j) * V + cur.c0 + i % 32, x);
            if (nx.len > 0) fq_rec_tok_ld<K, ES, VK>(tok, a, nx.bos, nx.hq, nx.j, nx.c0, t);
        } else {
            float S[8][K / 16];
            fq_rec_tile_read<K, VK>(S, fq_rec_smem + b * PC::stage_bytes, t);
            const int j = cur.j, c0 = cur.c0;
            const float A_log = a.A_log ? __ldg(a.A_log + j) : 0.f, dtb = a.dt_bias ? __ldg(a.dt_bias + j) : 0.f;
#pragma unroll 1
            for (int tk = 0; tk < cur.len; tk++) {
                /* the next token's inputs (this item's, else the next
                 * item's first) on their way while this one computes */
                fq_rec_tok<K, ES> nxt = tok;
                if (tk + 1 < cur.len) fq_rec_tok_ld<K, ES, VK>(nxt, a, cur.bos + tk + 1, cur.hq, j, c0, t);
                else if (nx.len > 0) fq_rec_tok_ld<K, ES, VK>(nxt, a, nx.bos, nx.hq, nx.j, nx.c0, t);
                fq_rec_token<K, ES, VK>(S, tok, a, &red[tk & 1][0][0][0], A_log, dtb, ((cur.bos + tk) * HV + j) * V,
                                        c0, t);
                if (a.inter) /* the state after token tk (speculative verify) */
                    fq_rec_tile_st<K, VK>(S, a.inter + (((int64_t)cur.n * a.Ti + tk) * HV + j) * (int64_t)K * V, V,
                                          c0, t);
                tok = nxt;
            }
            if (a.update) fq_rec_tile_st<K, VK>(S, a.state + cur.head, V, c0, t);
        }
        /* the next item's duplicate scan (its loads were issued before this item) */
        dup = fq_rec_dup_test(pd, a, nx, t);
        cur = nx;
    }
    fq_cp_async_wait<0>();
}

/* The decode step (one token per sequence, no cu_seqlens): one block per
 * item, the tile straight from the pool into registers, no stage, no item
 * loop — the fewest instructions between a launch and its stores (one
 * sequence is a matter of latency: ncu on the H100 counted 1360 warp
 * instructions per warp in the persistent kernel against FLA's 547;
 * benchmarks/NOTES.md session 18). The launcher takes it for every [K, V]
 * decode step, and for [V, K] where one wave holds every item. */
template <int K, int ES, int VK>
__global__ void __launch_bounds__(128, (K > 128 ? 2 : 4)) fq_decode_kernel(fq_rec_args a)
{
    __shared__ __align__(16) float red[4][8][FQ_REC_RED]; /* kv: [warp][column group][value] */
    /* the grid: x = (value head j, column slice), slices fastest, y = sequence n (the items in
     * the persistent kernel's order, without a division on the way to the index load: nsl =
     * V / 32 is 2, 4 or 8, a.lg_nsl its log2) */
    const int t = threadIdx.x, HV = a.HV, V = a.V, n = blockIdx.y;
    const int j = blockIdx.x >> a.lg_nsl, c0 = 32 * (blockIdx.x & ((1 << a.lg_nsl) - 1));

    /* programmatic dependent launch: nothing is read before the kernel
     * before this one is complete */
    fq_pdl_wait();
    fq_pdl_trigger();
    const int64_t slotraw = a.idx ? fq_ld_index(a.idx, a.idx_is64, n) : n;
    const int has_state = slotraw >= 0 && slotraw < a.P; /* (P < 2^31) */
    const int64_t head = ((int64_t)(has_state ? slotraw : 0) * HV + j) * (int64_t)K * V;
    const int hq = j / (HV / a.H); /* (after the index load is issued) */
    /* the state, the token (row n: T = 1) and the duplicate scan's loads
     * in flight together */
    float S[8][K / 16];
    if (has_state) fq_rec_tile_ld<K, VK>(S, a.state + head, V, c0, t);
    fq_rec_tok<K, ES> tok;
    fq_rec_tok_ld<K, ES, VK>(tok, a, n, hq, j, c0, t);
    const float A_log = a.A_log ? __ldg(a.A_log + j) : 0.f, dtb = a.dt_bias ? __ldg(a.dt_bias + j) : 0.f;
    int dup = 0;
    if (a.idx && has_state)
        for (int m = t; m < n; m += 128) dup |= fq_ld_index(a.idx, a.idx_is64, m) == slotraw;
    dup = __syncthreads_or(dup); /* (block-uniform) */
    const int64_t orow = ((int64_t)n * HV + j) * V;
    if (!has_state || dup) {
        /* padding: o row 0, the pool untouched; a duplicated slot: o row NaN, nothing written */
        if (t < 32) fq_st_f(a.o, a.dtype, orow + c0 + t, dup ? __int_as_float(0x7fc00000) : 0.f);
        return;
    }
    fq_rec_token<K, ES, VK>(S, tok, a, &red[0][0][0], A_log, dtb, orow, c0, t);
    if (a.inter) fq_rec_tile_st<K, VK>(S, a.inter + ((int64_t)n * a.Ti * HV + j) * (int64_t)K * V, V, c0, t);
    if (a.update) fq_rec_tile_st<K, VK>(S, a.state + head, V, c0, t);
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

/* The persistent kernel (128-thread blocks, two stages each; the grid at
 * most what is resident at once, block b walking items b, b + G, ...,
 * prefetching the next while it computes one), or the decode kernel (one
 * block per item). The persistent kernel's resident blocks per SM and its
 * shared-memory opt-in are settled once per kernel and device. */
template <int K, int ES, int VK>
static fq_status fq_rec_launch(const fq_rec_args &a, int64_t items, int one_token, int dev, cudaStream_t stream)
{
    void (*kern)(fq_rec_args) = fq_recurrent_kernel<K, ES, VK>;
    const size_t smem = 2 * (size_t)fq_rec_pieces<K, VK>::stage_bytes;
    static int per_sm_of[64]; /* [device] blocks per SM, 0: not yet asked */
    int per_sm = dev >= 0 && dev < 64 ? per_sm_of[dev] : 0;
    if (per_sm <= 0) {
        FQ_CUDA_CHECK(cudaFuncSetAttribute((const void *)kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        FQ_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, 128, smem));
        if (per_sm <= 0) per_sm = 1;
        if (dev >= 0 && dev < 64) per_sm_of[dev] = per_sm;
    }
    const int64_t resident = (int64_t)per_sm * fq_rec_sm_count(dev);
    /* The decode step by the one-item-per-block kernel on a [K, V] pool, and
     * on a [V, K] pool where one wave holds every item (N = 1: latency).
     * Measured on the H100 (benchmarks/NOTES.md sessions 18, 19), one block
     * per item against the persistent grid: [K, V] N = 64 x 32 heads 0.110
     * -> 0.100 ms, N = 256 0.427 -> 0.389, N = 16 with pools in turn (as a
     * model's layers: DRAM) 0.0298 -> 0.0268; for [V, K] tiles, contiguous
     * 16 KB, the persistent grid is faster at N = 64. The likely reason: a
     * [K, V] tile is a 128-byte piece of every state row, and the V / 32
     * items of a head read a row's pieces together only while they start
     * together, as blocks launched in item order do and persistent blocks,
     * drifting apart over their items, do not. (Grid y is the sequence:
     * N <= 65535.) */
    if (one_token && a.N <= 65535 && (!a.vk || items <= resident))
        return fq_launch_k(fq_decode_kernel<K, ES, VK>, dim3((unsigned)(a.HV << a.lg_nsl), (unsigned)a.N), 128u, 0,
                           stream, fq_cuda_pdl_enabled(), a);
    const int64_t blocks = items < resident ? items : resident;
    return fq_launch_k(kern, (unsigned)blocks, 128u, smem, stream, fq_cuda_pdl_enabled(), a);
}

template <int K>
static fq_status fq_rec_launch_dt(const fq_rec_args &a, int64_t items, int one, int dev, cudaStream_t stream)
{
    if (a.dtype == FQ_F32)
        return a.vk ? fq_rec_launch<K, 4, 1>(a, items, one, dev, stream)
                    : fq_rec_launch<K, 4, 0>(a, items, one, dev, stream);
    return a.vk ? fq_rec_launch<K, 2, 1>(a, items, one, dev, stream) : fq_rec_launch<K, 2, 0>(a, items, one, dev, stream);
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
    a.lg_nsl = p->V == 256 ? 3 : (p->V == 128 ? 2 : 1); /* V in {64, 128, 256} */
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
    const int64_t items = p->N * p->HV * (p->V / 32); /* V is 64, 128 or 256 */
    if (items <= 0) return FQ_OK;
    if (items > INT32_MAX / 2 || p->T > INT32_MAX || p->P > INT32_MAX)
        return fq_fail(FQ_ERR_VALUE, "the CUDA recurrent step takes fewer than 2^30 (sequence, value head, 32 "
                                     "columns) items and fewer than 2^31 tokens and pool slots");
    int dev = 0;
    FQ_CUDA_CHECK(cudaGetDevice(&dev));
    const int one = !p->cu_seqlens && p->T == 1; /* one token per item: the decode step */
    if (p->K == 128) return fq_rec_launch_dt<128>(a, items, one, dev, stream);
    if (p->K == 256) return fq_rec_launch_dt<256>(a, items, one, dev, stream); /* issue 7 item 4 */
    return fq_rec_launch_dt<64>(a, items, one, dev, stream);
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
