/*
 * gdn_cuda_fwd_wy.cu — forward stage A (DESIGN §2), per (chunk, value head).
 * Two kernels with the same outputs: the blocked one (fq_fwd_wy_blocked_kernel,
 * one block per (chunk, value head), blocked inverse), run by the three-stage
 * forward (fq_cuda_fwd_wy), and the persistent one
 * (fq_fwd_wy_persistent_kernel, double-buffered loads, recursive-doubling
 * inverse), run by the backward's recompute (fq_cuda_fwd_wy_recompute). A
 * third, fq_fwd_inverse_kernel (at the end), is the fused forward's stage A:
 * gamma, A'' = A diag(beta) and the gate record only. The first version
 * (column-per-thread 64-row forward substitution) was removed once
 * superseded: see benchmarks/NOTES.md and git history (commit 4599409).
 *
 *     gamma_r = sum_{s <= r} g_s                                  (fp32)
 *     L       = strict_lower( diag(beta) (K K^T ⊙ Gamma) )        Gamma_rs = e^{gamma_r - gamma_s}
 *     A       = (I + L)^-1                                        (fp32 forward substitution)
 *     W       = A diag(beta e^gamma) K                            (bf16 out)
 *     U       = A diag(beta) V                                    (bf16 out)
 *     kdecay_r = e^{gamma_C - gamma_r} rk_r                       (for stage B)
 *
 * With use_qk_l2norm, k = rk * k_raw: K K^T picks up rk_r rk_s, W picks up rk_r.
 * Padding rows of a short last chunk load as zeros (g = beta = 0), so W, U,
 * kdecay are zero there and gamma stays at gamma_{len-1}.
 *
 * Causality inside a chunk (issue 9), blocked and persistent kernels: the
 * products over the chunk (A diag(fw) K, A diag(beta) V) multiply the
 * structural zeros of A (above the diagonal) by the rows of later tokens, so
 * a NaN row would reach every row (0 * NaN = NaN). Hence
 *   fl = the first row whose L entries c <= r are not all finite (a
 *        non-finite k_r, g_r, beta_r, rk_r shows on row r, the diagonal
 *        included; 64: none), from L's own entries (fq_wy_lower), whose
 *        non-finite entries are zeroed by a select: A stays finite and its
 *        rows r < fl, which hold none, are exact;
 *   fv = the first row of the V tile holding a non-finite value (each thread
 *        scans the 16-byte pieces it loaded itself, after its cp.async wait:
 *        no new barrier), f = min(fl, fv);
 *   rare path (f < 64, block-uniform, one barrier): K rows >= fl and
 *        fw_c (c >= fl) zeroed, V rows >= f and beta_c (c >= f) zeroed, so
 *        W rows < fl and U rows < f come out exact (row r only needs the
 *        columns c <= r) and every row is finite (W rows >= fl, U rows >= f:
 *        finite values of no meaning);
 *   args.poison (the three-stage forward only): gamma_r = NaN for r >= f in
 *        the stored gamma, so stage B's e^{gamma_C} turns the state after the
 *        chunk into NaN and stage C's row factors e^{gamma_r} make o NaN from
 *        row f on; stage C's lower(Q K^T ⊙ Gamma) is a select, and Vn (from
 *        the finite U, W and chunk-start state) is finite, so o rows < f are
 *        exact. The backward's recompute keeps gamma (its rows >= f hold what
 *        the backward needs, see gdn_cuda_bwd_fused.cu).
 * The persistent kernel (the backward's recompute) also
 *   scans g' = isfinite(g) ? g : 0 (warp 0, a select per gate), tg = the
 *        chunk's first row of a non-finite g (a ballot; 64: none): gamma stays
 *        finite and exact for every pair r >= s >= the last bad row, whose
 *        gate differences exclude the bad g, so the reference's finite dv
 *        from a NaN g_t on in its chunk comes out (bwd_local's P, bwd_state's
 *        kdecay, bwd_wy's A: all finite now, rows < tg exact as before);
 *   rare path (min(fl, tg) < 64, block-uniform, one barrier): W's rows from
 *        min(fl, tg) on stored as NaN (the true W rows there see the bad
 *        k / beta / rk / g), so stage B's Vn = U - W h rows there, the state
 *        after the chunk (K^T (kdecay ⊙ Vn) sums over the rows) and
 *        bwd_state's W^T dVn (so dh0 and the earlier chunks' dS) are NaN, as
 *        the reference's; nothing the reference has finite reads those rows
 *        (dv = diag(b) A^T dVn and dVn = dv_local + kdecay (K dS) read no W
 *        and no Vn; dq before the bad token reads W's rows before it).
 *        Simulated in float64: dev/cuda/sim_causality_bwd.py.
 */
#include "gdn_cuda_common.cuh"

struct fq_wy_args {
    const fq_chunk_info *chunks;
    const fq_bf16 *kb, *vb;
    const void *g, *beta;
    fq_dtype gate_dtype;
    const float *rk, *rq;
    int H, HV;
    float *gamma, *kdecay;
    fq_bf16 *w, *u, *a;
    float *rec;  /* fq_fwd_inverse_kernel: the gate record (FQ_REC_*)            */
    float scale; /* fq_fwd_inverse_kernel: o's scale, for the record           */
    int poison;  /* blocked / persistent: gamma of the rows from a chunk's first
                    non-finite row on stored as NaN (the three-stage forward:
                    stage B's e^{gamma_C} and stage C's row factors then carry
                    the NaN; the backward's recompute keeps gamma as it is) */
};

/* ------------------------------------------------------------- blocked ----
 *
 * Same outputs as the removed first version, restructured so that no thread
 * runs a long serial chain (it had one thread per column walked all 64 rows, ~3000
 * straight-line instructions, ~18 us per block):
 *
 *   L      K K^T by mma; only the 16x16 blocks on or below the diagonal
 *   D_i    = (I + L_ii)^-1 for the four 16x16 diagonal blocks, one warp each
 *            (16-row forward substitution in fp32)
 *   A_ij   = -D_i sum_{k=j}^{i-1} L_ik A_kj       (i > j; A_jj = D_j)
 *            column block j by warp j (j = 0..2) in fp32 FFMA (16x16x16
 *            products from shared memory); a column block depends only on
 *            the D_i and on itself, so only __syncwarp inside
 *   W      = (A diag(beta e^gamma rk)) K,  U = (A diag(beta)) V
 *            the column factors are applied to A in fp32 before its bf16
 *            rounding as the mma operand; warp w owns output columns
 *            w*K/4.. (balanced), k-steps above the diagonal of A skipped
 *
 * A stays fp32 until it is an mma operand (or ws->a).
 */
#define FQ_WY_LDF 72 /* fp32 row stride of L and A: conflict-free float2 fragment reads */

/* K, L, A tiles; V is loaded only once L is dead, into L's place (64 x LDV
 * bf16 <= 64 x FQ_WY_LDF fp32 for V <= 128), while W is computed: 54 KB at
 * K = V = 128, 4 blocks per SM (the first layout kept V beside L: 72 KB, 3
 * blocks; benchmarks/NOTES.md, "lean stage A"). At V = 256 the V tile
 * (33 KB) is larger than L's place (18 KB): it gets its own region after
 * the others, 105.5 KB at K = V = 256, 2 blocks per SM. */
template <int K, int V> struct fq_wy_blocked_smem {
    static constexpr int LDK = K + 8, LDV = V + 8;
    static constexpr int lbytes = 64 * FQ_WY_LDF * 4;          /* L, A: 64 x 72 fp32 */
    static constexpr bool v_in_l = 64 * LDV * 2 <= lbytes;     /* V <= 136 */
    static constexpr int off_k = 0;
    static constexpr int off_l = off_k + 64 * LDK * 2;
    static constexpr int off_a = off_l + lbytes;
    static constexpr int off_vec = off_a + lbytes;
    static constexpr int off_f = off_vec + 4 * 64 * 4; /* fl, fv (causality, the header) */
    static constexpr int off_v = v_in_l ? off_l : off_f + 16;
    static constexpr int bytes = v_in_l ? off_f + 16 : off_v + 64 * LDV * 2;
    static_assert(off_v % 16 == 0, "cp.async destinations are 16-byte aligned");
};

/* acc[0..7] += (X Y)[r][cb..cb+7] for 16x16 fp32 blocks X, Y in shared memory
 * (row stride FQ_WY_LDF). Lanes: r = lane / 2, cb = 8 (lane % 2). */
static __device__ __forceinline__ void fq_mm16_acc(float acc[8], const float *X, const float *Y, int r, int cb)
{
#pragma unroll
    for (int k0 = 0; k0 < 16; k0 += 4) {
        const float4 x = *(const float4 *)(X + r * FQ_WY_LDF + k0);
        const float xs[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            const float4 y0 = *(const float4 *)(Y + (k0 + kk) * FQ_WY_LDF + cb);
            const float4 y1 = *(const float4 *)(Y + (k0 + kk) * FQ_WY_LDF + cb + 4);
            acc[0] += xs[kk] * y0.x;
            acc[1] += xs[kk] * y0.y;
            acc[2] += xs[kk] * y0.z;
            acc[3] += xs[kk] * y0.w;
            acc[4] += xs[kk] * y1.x;
            acc[5] += xs[kk] * y1.y;
            acc[6] += xs[kk] * y1.z;
            acc[7] += xs[kk] * y1.w;
        }
    }
}

/* out[:, c0 .. c0+NC) = (A diag(f)) B over the 64 chunk rows, one warp:
 * A fp32 (Af, lower triangular: k-steps above the diagonal skipped), f one
 * factor per column of A, B bf16 [64][*] in shared memory (row stride ldb);
 * out bf16 in global memory (row stride ld). */
template <int NC>
static __device__ __forceinline__ void fq_wy_apply(const float *Af, const float *f, const fq_bf16 *Bs, int ldb,
                                                    int c0, fq_bf16 *out, int ld)
{
    const int lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int m = 0; m < 4; m++) {
        /* one m16 row tile at a time (few live registers) */
        float acc[NC / 8][4];
#pragma unroll
        for (int n = 0; n < NC / 8; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk <= m; kk++) {
            const int ca = 16 * kk + 2 * tq;
            const float2 f0 = *(const float2 *)(f + ca), f8 = *(const float2 *)(f + ca + 8);
            const float *ar = Af + (16 * m + gq) * FQ_WY_LDF + ca;
            const float2 p00 = *(const float2 *)ar, p10 = *(const float2 *)(ar + 8 * FQ_WY_LDF);
            const float2 p01 = *(const float2 *)(ar + 8), p11 = *(const float2 *)(ar + 8 * FQ_WY_LDF + 8);
            uint32_t a[4];
            a[0] = fq_pack_bf16(p00.x * f0.x, p00.y * f0.y);
            a[1] = fq_pack_bf16(p10.x * f0.x, p10.y * f0.y);
            a[2] = fq_pack_bf16(p01.x * f8.x, p01.y * f8.y);
            a[3] = fq_pack_bf16(p11.x * f8.x, p11.y * f8.y);
#pragma unroll
            for (int n2 = 0; n2 < NC / 16; n2++) {
                uint32_t b[4];
                fq_frag_b_kn(b, Bs, ldb, 16 * kk, c0 + 16 * n2);
                fq_mma_bf16(acc[2 * n2], a, b[0], b[1]);
                fq_mma_bf16(acc[2 * n2 + 1], a, b[2], b[3]);
            }
        }
#pragma unroll
        for (int n = 0; n < NC / 8; n++) {
            int r = 16 * m + gq, c = c0 + 8 * n + 2 * tq;
            *(uint32_t *)(out + r * ld + c) = fq_pack_bf16(acc[n][0], acc[n][1]);
            *(uint32_t *)(out + (r + 8) * ld + c) = fq_pack_bf16(acc[n][2], acc[n][3]);
        }
    }
}

/* Rows r < ci.len of chunk ci of one head of a bf16 [rows, nheads, NC] array
 * into a [64][LD] shared tile by cp.async (128 threads; rows past len become
 * zeros: a 0-byte copy from the base); tid = threadIdx.x. No commit. Thread
 * tid copies the 16 bytes at column pc of rows r0, r0 + RPI, ... (the pieces
 * idx = tid + 128 m of the tile, idx = PPR r + pc / 8), from one base pointer
 * stepped by RPI rows. The K and V tiles of every stage A kernel. */
template <int NC, int LD>
static __device__ __forceinline__ void fq_wy_load_rows(fq_bf16 *dst, const fq_bf16 *base, int nheads, int head,
                                                       fq_chunk_info ci, int tid)
{
    constexpr int PPR = NC / 8, RPI = 128 / PPR;
    const int pc = (tid % PPR) * 8, r0 = tid / PPR;
    fq_bf16 *d = dst + r0 * LD + pc;
    const fq_bf16 *src = base + ((int64_t)(ci.row0 + r0) * nheads + head) * NC + pc;
    const int64_t step = (int64_t)RPI * nheads * NC;
#pragma unroll
    for (int m = 0; m < 64 / RPI; m++) {
        const int ok = r0 + RPI * m < ci.len;
        fq_cp_async16(d + RPI * m * LD, ok ? (const void *)(src + m * step) : (const void *)base, ok ? 16 : 0);
    }
}

/* acc = block row `row` of K K^T (rows 16 row.., column blocks 0..row; the
 * blocks above stay zero) as mma.sync accumulators, acc[n] the n8 block n, from
 * the bf16 K tile Ks [64][LDK] in shared memory. Shared by every stage A kernel:
 * the blocked and persistent ones pass the warp as `row` (WMAX = 3: products
 * above it are predicated off, still issued), fq_fwd_inverse_kernel the row
 * at compile time (row = WMAX: a warp issues only its 16 (row + 1)). */
template <int K, int LDK, int WMAX>
static __device__ __forceinline__ void fq_kkt_block_row(float (*acc)[4], const fq_bf16 *Ks, int row)
{
#pragma unroll
    for (int n = 0; n < 8; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++) {
        uint32_t a[4];
        fq_frag_a(a, Ks, LDK, 16 * row, 16 * kk);
#pragma unroll
        for (int n2 = 0; n2 <= WMAX; n2++) {
            if (n2 > row) continue;
            uint32_t b[4];
            fq_frag_b_nk(b, Ks, LDK, 16 * n2, 16 * kk);
            fq_mma_bf16(acc[2 * n2], a, b[0], b[1]);
            fq_mma_bf16(acc[2 * n2 + 1], a, b[2], b[3]);
        }
    }
}

/* Shared by the blocked and persistent kernels (one 64-token chunk, 4 warps, fp32 tiles of
 * row stride FQ_WY_LDF in shared memory):
 * L = strict_lower(diag(beta) (K K^T ⊙ Gamma)), scaled by the inverse key norms
 * rk: warp w writes rows 16w..16w+15, column blocks 0..w (the blocks above stay
 * unwritten: the callers use them as scratch).
 * Causality (the header): an entry c <= r (the diagonal included, computed
 * only for this test) that is not finite marks row r bad (atomicMin of r into
 * *sfl, rare; read after the caller's next barrier) and is stored as zero
 * (a select), so L stays finite. */
template <int K, int LDK>
static __device__ __forceinline__ void fq_wy_lower(const fq_bf16 *Ks, float *Lf, const float *gam,
                                                   const float *bet, const float *rkv, int warp, int gq,
                                                   int tq, int *sfl)
{
    constexpr int LDF = FQ_WY_LDF;
    float acc[8][4];
    fq_kkt_block_row<K, LDK, 3>(acc, Ks, warp);
    int bad[2] = {0, 0};
#pragma unroll
    for (int n = 0; n < 8; n++) {
        if ((n >> 1) > warp) continue;
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            int r = 16 * warp + gq + 8 * hr, c = 8 * n + 2 * tq;
            float fr = bet[r] * rkv[r];
            const float x0 = fr * rkv[c] * __expf(gam[r] - gam[c]) * acc[n][2 * hr];
            const float x1 = fr * rkv[c + 1] * __expf(gam[r] - gam[c + 1]) * acc[n][2 * hr + 1];
            const int f0 = isfinite(x0), f1 = isfinite(x1);
            bad[hr] |= (c <= r && !f0) | (c + 1 <= r && !f1);
            float2 x;
            x.x = (c < r && f0) ? x0 : 0.f;
            x.y = (c + 1 < r && f1) ? x1 : 0.f;
            *(float2 *)(Lf + r * LDF + c) = x;
        }
    }
#pragma unroll
    for (int hr = 0; hr < 2; hr++)
        if (bad[hr]) atomicMin(sfl, 16 * warp + gq + 8 * hr);
}

/* Causality (the header): the first row of a [64][LD] bf16 tile loaded by
 * fq_wy_load_rows<NC, LD> holding a non-finite value, atomicMin'ed into *sf
 * (rare). Each thread reads only the 16-byte pieces it copied itself, so it
 * runs right after the thread's cp.async wait, before the barrier that
 * publishes the tile; *sf is read after that barrier. */
template <int NC, int LD>
static __device__ __forceinline__ void fq_wy_scan_rows(const fq_bf16 *tile, int tid, int *sf)
{
    for (int idx = tid; idx < 64 * (NC / 8); idx += 128) {
        int r = idx / (NC / 8), c = (idx % (NC / 8)) * 8;
        if (fq_bf16x8_nonfinite(*(const uint4 *)(tile + r * LD + c))) atomicMin(sf, r);
    }
}

/* Causality, the rare paths (block-uniform; the caller puts a barrier
 * after each): rows >= fl of the K tile and fw_c for c >= fl (before W), rows
 * >= f of the V tile and beta_c for c >= f (before U), to zero (selects by
 * index, no multiplication), so that W = (A diag(fw)) K and
 * U = (A diag(beta)) V never meet a non-finite value (A is finite): rows
 * < fl of W and < f of U exact, every row finite. */
template <int NC, int LD>
static __device__ __forceinline__ void fq_wy_cut(fq_bf16 *tile, float *colf, int from, int tid)
{
    for (int idx = tid; idx < 64 * (NC / 8); idx += 128) {
        int r = idx / (NC / 8), c = (idx % (NC / 8)) * 8;
        if (r >= from) *(uint4 *)(tile + r * LD + c) = make_uint4(0, 0, 0, 0);
    }
    if (tid < 64 && tid >= from) colf[tid] = 0.f;
}

/* One warp: the gates g, beta and inverse key norms rk of the chunk's tokens
 * lane and lane + 32 (zeros past the chunk, or for no chunk: ci.seq < 0). */
static __device__ __forceinline__ void fq_wy_gates(const fq_wy_args &args, fq_chunk_info ci, int j, float gv[2],
                                                    float bv[2], float rv[2])
{
    const int lane = threadIdx.x & 31, hq = j / (args.HV / args.H);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int r = lane + 32 * h;
        gv[h] = bv[h] = rv[h] = 0.f;
        if (ci.seq >= 0 && r < ci.len) {
            int64_t gi = (int64_t)(ci.row0 + r) * args.HV + j;
            gv[h] = fq_gate_load(args.g, args.gate_dtype, gi); /* full resets: -inf -> -100 */
            bv[h] = fq_ld_f(args.beta, args.gate_dtype, gi);
            rv[h] = args.rk ? args.rk[(int64_t)(ci.row0 + r) * args.H + hq] : 1.f;
        }
    }
}

/* The inclusive prefix sum of a chunk's 64 values over one warp: x[0] holds
 * token lane, x[1] token lane + 32. */
static __device__ __forceinline__ void fq_warp_cumsum64(float x[2], int lane)
{
    for (int o = 1; o < 32; o <<= 1) {
        float y0 = __shfl_up_sync(0xffffffffu, x[0], o), y1 = __shfl_up_sync(0xffffffffu, x[1], o);
        if (lane >= o) { x[0] += y0; x[1] += y1; }
    }
    x[1] += __shfl_sync(0xffffffffu, x[0], 31);
}

/* gamma = cumsum(g) over the chunk (one warp: tokens lane and lane + 32), and
 * the vectors beta, rk and the W column factors fw = beta e^gamma rk into
 * shared memory, from the gates of fq_wy_gates. */
static __device__ __forceinline__ void fq_wy_gate_scan(float gv[2], const float bv[2], const float rv[2], float *gam,
                                                       float *bet, float *rkv, float *fw, int lane)
{
    fq_warp_cumsum64(gv, lane);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int r = lane + 32 * h;
        gam[r] = gv[h];
        bet[r] = bv[h];
        rkv[r] = rv[h];
        fw[r] = bv[h] * __expf(gv[h]) * rv[h];
    }
}

/* Causality, the persistent kernel only (the header): g' = isfinite(g) ? g : 0
 * for the gates of fq_wy_gates (one warp, before fq_wy_gate_scan), and the
 * returned tg = the first chunk row with a non-finite g (64: none), the
 * same in every lane. */
static __device__ __forceinline__ int fq_wy_gates_finite(float gv[2])
{
    const int ok0 = isfinite(gv[0]), ok1 = isfinite(gv[1]);
    const unsigned b0 = __ballot_sync(0xffffffffu, !ok0), b1 = __ballot_sync(0xffffffffu, !ok1);
    gv[0] = ok0 ? gv[0] : 0.f;
    gv[1] = ok1 ? gv[1] : 0.f;
    return b0 ? __ffs(b0) - 1 : (b1 ? 31 + __ffs(b1) : 64);
}

/* Causality, the persistent kernel's rare path (the header): rows from..len-1
 * of one item's W tile in global memory (64 x K bf16) to NaN (the padding
 * rows stay zero); 128 threads, after a barrier that orders them behind
 * fq_wy_apply's stores. */
template <int K>
static __device__ __forceinline__ void fq_wy_poison_w(fq_bf16 *w, int from, int len, int tid)
{
    for (int idx = tid; idx < 64 * (K / 8); idx += 128) {
        int r = idx / (K / 8), c = (idx % (K / 8)) * 8;
        if (r >= from && r < len) *(uint4 *)(w + r * K + c) = make_uint4(0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u);
    }
}

/* D_w = (I + L_ww)^-1, the inverse of warp w's diagonal block: lane -> column
 * c = lane % 16 (lanes 16..31 repeat lanes 0..15),
 * D[i][c] = delta_ic - sum_{j<i} L[i][j] D[j][c]; written to Af's block (w, w). */
static __device__ __forceinline__ void fq_wy_diag_inverse(const float *Lf, float *Af, int warp, int lane)
{
    constexpr int LDF = FQ_WY_LDF;
    const int b = 16 * warp, c = lane & 15;
    float x[16];
#pragma unroll
    for (int i = 0; i < 16; i++) x[i] = 0.f;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        float s0 = (i == c) ? 1.f : 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma unroll
        for (int jb = 0; jb < i; jb += 4) {
            float4 l4 = *(const float4 *)(Lf + (b + i) * LDF + b + jb);
            s0 -= l4.x * x[jb];
            s1 -= l4.y * x[jb + 1];
            s2 -= l4.z * x[jb + 2];
            s3 -= l4.w * x[jb + 3];
        }
        x[i] = (s0 + s1) + (s2 + s3);
    }
    if (lane < 16) {
#pragma unroll
        for (int i = 0; i < 16; i++) Af[(b + i) * LDF + b + c] = x[i];
    }
}

/* The end of one item (tile = (chunk * HV + j) * 64, 128 threads): the bf16 A
 * for the backward when args.a is set, zeros above the diagonal (those
 * blocks of Af were never written), and gamma, kdecay for stage B; with
 * args.poison, gamma_r = NaN for r >= f (causality, the header). */
static __device__ __forceinline__ void fq_wy_store(const fq_wy_args &args, int64_t tile, const float *Af,
                                                   const float *gam, const float *rkv, int len, int f, int tid)
{
    constexpr int LDF = FQ_WY_LDF;
    if (args.a) {
        fq_bf16 *ag = args.a + tile * 64;
        for (int idx = tid; idx < 64 * 8; idx += 128) {
            int r = idx >> 3, c = (idx & 7) * 8;
            float4 x0 = *(const float4 *)(Af + r * LDF + c), x1 = *(const float4 *)(Af + r * LDF + c + 4);
            float xs[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
            uint32_t pk[4];
#pragma unroll
            for (int e = 0; e < 4; e++)
                pk[e] = fq_pack_bf16(c + 2 * e <= r ? xs[2 * e] : 0.f, c + 2 * e + 1 <= r ? xs[2 * e + 1] : 0.f);
            *(uint4 *)(ag + r * 64 + c) = make_uint4(pk[0], pk[1], pk[2], pk[3]);
        }
    }
    if (tid < 64) {
        args.gamma[tile + tid] = args.poison && tid >= f ? __int_as_float(0x7fc00000) : gam[tid];
        args.kdecay[tile + tid] = tid < len ? __expf(gam[63] - gam[tid]) * rkv[tid] : 0.f;
    }
}

/* 4 blocks per SM by shared memory, 2 at K = V = 256 (up to 255 registers:
 * at 128 its K K^T and W products spilled) */
template <int K, int V>
__global__ void __launch_bounds__(128, (K > 128 || V > 128) ? 2 : 4) fq_fwd_wy_blocked_kernel(fq_wy_args args)
{
    typedef fq_wy_blocked_smem<K, V> SM;
    constexpr int LDF = FQ_WY_LDF;
    extern __shared__ __align__(16) unsigned char smem[];
    fq_bf16 *Ks = (fq_bf16 *)(smem + SM::off_k);
    fq_bf16 *Vs = (fq_bf16 *)(smem + SM::off_v);
    float *Lf = (float *)(smem + SM::off_l);
    float *Af = (float *)(smem + SM::off_a);
    float *gam = (float *)(smem + SM::off_vec);
    float *bet = gam + 64, *rkv = gam + 128, *fw = gam + 192;

    const int HV = args.HV;
    const int chunk = blockIdx.x / HV, j = blockIdx.x % HV;
    /* programmatic dependent launch (gdn_cuda_common.cuh): stage B may be
     * scheduled as soon as every block of this grid runs; nothing here may
     * be read before the previous kernel is complete */
    fq_pdl_trigger();
    fq_pdl_wait();
    const fq_chunk_info ci = args.chunks[chunk];
    if (ci.seq < 0) return;
    const int hq = j / (HV / args.H);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gq = lane >> 2, tq = lane & 3;

    int *sf = (int *)(smem + SM::off_f); /* fl, fv (causality, the header) */
    if (tid == 0) sf[0] = sf[1] = 64;   /* read after the barriers below */
    fq_wy_load_rows<K, SM::LDK>(Ks, args.kb, args.H, hq, ci, tid);
    auto load_v = [&]() { fq_wy_load_rows<V, SM::LDV>(Vs, args.vb, HV, j, ci, tid); };
    fq_cp_async_commit(); /* K only: V comes once L is dead */
    /* gamma = cumsum(g) (one warp: tokens lane and lane + 32), beta, rk and
     * the W column factors fw = beta e^gamma rk */
    if (warp == 0) {
        /* the loads of fq_wy_gates, written out: through it (its ci.seq
         * test, its own hq) this kernel compiled to different code */
        float gv[2], bv[2], rv[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int r = lane + 32 * h;
            gv[h] = bv[h] = rv[h] = 0.f;
            if (r < ci.len) {
                int64_t gi = (int64_t)(ci.row0 + r) * HV + j;
                gv[h] = fq_gate_load(args.g, args.gate_dtype, gi); /* full resets: -inf -> -100 */
                bv[h] = fq_ld_f(args.beta, args.gate_dtype, gi);
                rv[h] = args.rk ? args.rk[(int64_t)(ci.row0 + r) * args.H + hq] : 1.f;
            }
        }
        fq_wy_gate_scan(gv, bv, rv, gam, bet, rkv, fw, lane);
    }
    fq_cp_async_wait<0>();
    __syncthreads();

    /* L = strict_lower(diag(beta) (K K^T ⊙ Gamma)) */
    fq_wy_lower<K, SM::LDK>(Ks, Lf, gam, bet, rkv, warp, gq, tq, sf);
    __syncthreads();

    /* D_w = (I + L_ww)^-1 for each warp's diagonal block */
    fq_wy_diag_inverse(Lf, Af, warp, lane);
    __syncthreads();

    /* A_ij = -D_i sum_{k=j}^{i-1} L_ik A_kj, column block jb by warp jb; the
     * partial sum T goes through the unused upper block (0, jb+1) of Lf */
    if (warp < 3) {
        const int jb = warp, r = lane >> 1, cb = (lane & 1) * 8;
        float *T = Lf + 16 * (jb + 1);
#pragma unroll 1
        for (int i = jb + 1; i < 4; i++) {
            float acc[8];
#pragma unroll
            for (int e = 0; e < 8; e++) acc[e] = 0.f;
#pragma unroll 1
            for (int k = jb; k < i; k++) fq_mm16_acc(acc, Lf + 16 * i * LDF + 16 * k, Af + 16 * k * LDF + 16 * jb, r, cb);
            *(float4 *)(T + r * LDF + cb) = make_float4(acc[0], acc[1], acc[2], acc[3]);
            *(float4 *)(T + r * LDF + cb + 4) = make_float4(acc[4], acc[5], acc[6], acc[7]);
            __syncwarp();
#pragma unroll
            for (int e = 0; e < 8; e++) acc[e] = 0.f;
            fq_mm16_acc(acc, Af + 16 * i * LDF + 16 * i, T, r, cb);
            float *dst = Af + (16 * i + r) * LDF + 16 * jb + cb;
            *(float4 *)dst = make_float4(-acc[0], -acc[1], -acc[2], -acc[3]);
            *(float4 *)(dst + 4) = make_float4(-acc[4], -acc[5], -acc[6], -acc[7]);
            __syncwarp();
        }
    }
    __syncthreads();

    /* W = (A diag(fw)) K, U = (A diag(beta)) V: warp w, columns w*K/4..
     * (L is dead after the barrier above; V lands in its place, at V = 256
     * in a region of its own, while W is computed) */
    const int64_t tile = (int64_t)blockIdx.x * 64; /* (chunk * HV + j) * 64 */
    const int fl = sf[0];
    if (fl < 64) { /* causality, rare: K rows, fw from fl on */
        fq_wy_cut<K, SM::LDK>(Ks, fw, fl, tid);
        __syncthreads();
    }
    load_v();
    fq_cp_async_commit();
    fq_wy_apply<K / 4>(Af, fw, Ks, SM::LDK, warp * (K / 4), args.w + tile * K, K);
    fq_cp_async_wait<0>();
    fq_wy_scan_rows<V, SM::LDV>(Vs, tid, sf + 1); /* this thread's own V pieces */
    __syncthreads();
    const int f = min(fl, sf[1]);
    if (f < 64) { /* causality, rare: V rows, beta from f on */
        fq_wy_cut<V, SM::LDV>(Vs, bet, f, tid);
        __syncthreads();
    }
    fq_wy_apply<V / 4>(Af, bet, Vs, SM::LDV, warp * (V / 4), args.u + tile * V, V);
    fq_wy_store(args, tile, Af, gam, rkv, ci.len, f, tid);
}

/* The kernels' arguments, the same for all three. */
static fq_wy_args fq_wy_args_of(const fq_gdn_params *p, const fq_fwd_ws *ws)
{
    fq_wy_args args;
    args.chunks = ws->chunks;
    args.kb = ws->kb;
    args.vb = ws->vb;
    args.g = p->g;
    args.beta = p->beta;
    args.gate_dtype = p->gate_dtype;
    args.rk = ws->rk;
    args.rq = ws->rq;
    args.rec = NULL;
    args.scale = (float)p->scale;
    args.poison = 0;
    args.H = (int)p->H;
    args.HV = (int)p->HV;
    args.gamma = ws->gamma;
    args.kdecay = ws->kdecay;
    args.w = ws->w;
    args.u = ws->u;
    args.a = ws->a;
    return args;
}

template <int K, int V>
static fq_status fq_launch_wy_blocked(const fq_wy_args &args, int64_t blocks, cudaStream_t stream)
{
    int bytes = fq_wy_blocked_smem<K, V>::bytes;
    fq_status st = fq_cuda_set_smem((const void *)fq_fwd_wy_blocked_kernel<K, V>, bytes);
    if (st != FQ_OK) return st;
    return fq_launch_k(fq_fwd_wy_blocked_kernel<K, V>, (unsigned)blocks, 128, bytes, stream,
                       fq_cuda_pdl_enabled(), args);
}

extern "C" fq_status fq_cuda_fwd_wy_blocked(const fq_gdn_params *p, const fq_fwd_ws *ws, cudaStream_t stream)
{
    int64_t blocks = ws->nc_max * p->HV;
    if (blocks <= 0) return FQ_OK;
    fq_wy_args args = fq_wy_args_of(p, ws);
    args.poison = 1; /* the three-stage forward's stage A (causality, the header) */
    if (p->K == 128 && p->V == 128) return fq_launch_wy_blocked<128, 128>(args, blocks, stream);
    if (p->K == 128 && p->V == 64) return fq_launch_wy_blocked<128, 64>(args, blocks, stream);
    if (p->K == 64 && p->V == 128) return fq_launch_wy_blocked<64, 128>(args, blocks, stream);
    if (p->K == 64 && p->V == 64) return fq_launch_wy_blocked<64, 64>(args, blocks, stream);
    if (p->K == 256 && p->V == 256) return fq_launch_wy_blocked<256, 256>(args, blocks, stream); /* issue 7 item 4 */
    return fq_cuda_head_dims_unsupported(p);
}

/* ---------------------------------------------------------- persistent ----
 *
 * Same outputs as the blocked kernel (same L, same diagonal inverses, same W/U code), made
 * persistent and pipelined, and with a shallower inverse:
 *
 *   grid    min(items, SMs x blocks per SM) blocks of 128 threads (2 per SM by
 *           shared memory), each looping over the work items it = (chunk,
 *           value head) = blockIdx.x, blockIdx.x + gridDim.x, ...
 *   loads   K and V tiles double-buffered: item i+1's cp.async group is issued
 *           before item i's compute starts, its g, beta, rk loads go to
 *           registers of warp 0 meanwhile and its chunk-table entry is read one
 *           item earlier still, so no load latency is on the critical path;
 *           W, U stores are fire-and-forget as before
 *   A       (I + L)^-1 by recursive doubling on the 16x16 blocks (blocked: column
 *           block by column block, 9 dependent 16^3 products on warp 0):
 *             D_i  = (I + L_ii)^-1                              4 warps (as blocked)
 *             A_10 = -D_1 (L_10 D_0),  A_32 = -D_3 (L_32 D_2)     warps 0, 1
 *             T_ij = sum_k L_ik Inv0_kj   (i = 2,3; j = 0,1;  Inv0 = [D_0 0; A_10 D_1])
 *                    T_2j = L_20 D_0 + L_21 A_10 (j = 0), L_21 D_1 (j = 1); T_3j likewise
 *             A_2j = -D_2 T_2j,  A_3j = -(A_32 T_2j + D_3 T_3j)      warp w: (2 + w/2, w%2)
 *           (the 2x2 block rule [P 0; Q R]^-1 = [P^-1 0; -R^-1 Q P^-1 R^-1]
 *           applied at 32 then 64 rows): 6 dependent products, all fp32 FFMA
 *           from shared memory as in the blocked kernel (other association order only).
 *           Scratch T: the blocks above the diagonal of Lf (never written by L).
 */
template <int K, int V, bool UO> struct fq_wy_persistent_smem {
    static constexpr int LDK = K + 8, LDV = V + 8;
    /* (UO = false: no U to form, so no V tiles either: off_v0 / off_v1 then
     * coincide with the next K tile and are never dereferenced) */
    static constexpr int kbytes = 64 * LDK * 2, vbytes = UO ? 64 * LDV * 2 : 0;
    static constexpr int off_k0 = 0;
    static constexpr int off_v0 = off_k0 + kbytes;
    static constexpr int off_k1 = off_v0 + vbytes;
    static constexpr int off_v1 = off_k1 + kbytes;
    static constexpr int off_l = off_v1 + vbytes;
    static constexpr int off_a = off_l + 64 * FQ_WY_LDF * 4;
    static constexpr int off_vec = off_a + 64 * FQ_WY_LDF * 4;
    static constexpr int off_f = off_vec + 4 * 64 * 4; /* fl, fv of items of even / odd parity, tg (causality) */
    static constexpr int bytes = off_f + 32;
};

/* One 16x16 fp32 block product into shared memory, one warp:
 * out = sign * (X0 Y0 [+ X1 Y1]) (X1 == NULL: one term); all blocks row
 * stride FQ_WY_LDF. out must not alias an input. */
static __device__ __forceinline__ void fq_wy_blk_product(float *out, float sign, const float *X0, const float *Y0,
                                                  const float *X1, const float *Y1)
{
    const int lane = threadIdx.x & 31, r = lane >> 1, cb = (lane & 1) * 8;
    float acc[8];
#pragma unroll
    for (int e = 0; e < 8; e++) acc[e] = 0.f;
    fq_mm16_acc(acc, X0, Y0, r, cb);
    if (X1) fq_mm16_acc(acc, X1, Y1, r, cb);
    float *dst = out + r * FQ_WY_LDF + cb;
    *(float4 *)dst = make_float4(sign * acc[0], sign * acc[1], sign * acc[2], sign * acc[3]);
    *(float4 *)(dst + 4) = make_float4(sign * acc[4], sign * acc[5], sign * acc[6], sign * acc[7]);
}

/* K, V rows of chunk ci (value head j, q/k head hq) -> shared, asynchronously
 * (zeros past len). No commit. */
template <int K, int V, bool UO>
static __device__ __forceinline__ void fq_wy_issue_loads(const fq_wy_args &args, fq_chunk_info ci, int j, fq_bf16 *Ks,
                                                    fq_bf16 *Vs)
{
    typedef fq_wy_persistent_smem<K, V, UO> SM;
    const int tid = threadIdx.x, hq = j / (args.HV / args.H);
    fq_wy_load_rows<K, SM::LDK>(Ks, args.kb, args.H, hq, ci, tid);
    if (UO) fq_wy_load_rows<V, SM::LDV>(Vs, args.vb, args.HV, j, ci, tid);
}

/* g, beta, rk of tokens lane and lane + 32 of chunk ci (zeros past len, or
 * everywhere when ci.seq < 0), into registers; warp 0 only. */
static __device__ __forceinline__ fq_chunk_info fq_wy_item_chunk(const fq_wy_args &args, int64_t it, int64_t items)
{
    fq_chunk_info ci;
    if (it < items) {
        ci = args.chunks[it / args.HV];
    } else {
        ci.seq = -1;
        ci.row0 = ci.len = ci.local = 0;
    }
    return ci;
}

/* UO: U formed (the backward's three-stage recompute, whose state pass reads
 * it). Without U (the backward's fused recompute, whose chain forms Vn
 * itself) no V tile is loaded either: V only ever enters U and U's cut
 * (f = min(fl, fv) below; gamma, kdecay, A and W never depend on fv). Blocks
 * per SM by shared memory: with U 2 (K = V = 128: 105 KB), 1 at K = V = 256
 * (169 KB: four 33 KB tiles); without U 3 (71 KB), 2 at 256 (103 KB). */
template <int K, int V, bool UO, bool AG>
__global__ void __launch_bounds__(128, (K > 128 || V > 128) ? (UO ? 1 : 2) : (UO ? 2 : 3))
fq_fwd_wy_persistent_kernel(fq_wy_args args, int64_t items, int *aflag)
{
    static_assert(!(UO && AG), "mode AG is the fused recompute's (no U)");
    typedef fq_wy_persistent_smem<K, V, UO> SM;
    constexpr int LDF = FQ_WY_LDF;
    extern __shared__ __align__(16) unsigned char smem[];
    float *Lf = (float *)(smem + SM::off_l);
    float *Af = (float *)(smem + SM::off_a);
    float *gam = (float *)(smem + SM::off_vec);
    float *bet = gam + 64, *rkv = gam + 128, *fw = gam + 192;
    /* causality (the header): fl, fv of the item in slot buf (2 ints); the
     * other slot is reset for the next item after the loop-top barrier, once
     * the previous item (its user) has read it; sf[4] = tg of the item (set by
     * warp 0 before the barrier after the gate scan, read after it, rewritten
     * only after the next loop-top barrier) */
    int *sf = (int *)(smem + SM::off_f);

    const int HV = args.HV;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gq = lane >> 2, tq = lane & 3;
    const int64_t stride = gridDim.x;

    /* The block walks positions k = blockIdx.x, + stride, ... of its items:
     * item k itself; AG (the fused recompute, after its stage A wrote A,
     * gamma, kdecay and the list of the items holding a non-finite input:
     * aflag[items] of them at aflag + items + 1), the k-th listed item, formed
     * in full by the backward's rules (an empty list: nothing to do). aflag,
     * written (AG: for the listed items; else, when given, for every item): 1
     * where W's rows from a bad token before the chunk's end are NaN
     * (bwd_state90's implicit W makes those items' update NaN).
     * Prologue: the first item's tiles and gates in flight, the next one's
     * chunk-table entry read */
    const int64_t cnt = AG ? (int64_t)aflag[items] : items;
    auto item_at = [&](int64_t k) -> int64_t {
        if (!AG) return k;
        return k < cnt ? (int64_t)aflag[items + 1 + k] : items; /* (items: none, fq_wy_item_chunk) */
    };
    int64_t k = blockIdx.x, it = item_at(k), nit = item_at(k + stride);
    fq_chunk_info ci = fq_wy_item_chunk(args, it, items);
    fq_chunk_info cn = fq_wy_item_chunk(args, nit, items);
    if (ci.seq >= 0)
        fq_wy_issue_loads<K, V, UO>(args, ci, (int)(it % HV), (fq_bf16 *)(smem + SM::off_k0), (fq_bf16 *)(smem + SM::off_v0));
    fq_cp_async_commit();
    float gv[2] = {0.f, 0.f}, bv[2] = {0.f, 0.f}, rv[2] = {0.f, 0.f};
    if (warp == 0) fq_wy_gates(args, ci, (int)(it % HV), gv, bv, rv);
    if (tid == 0) sf[0] = sf[1] = sf[2] = sf[3] = 64; /* read after the loop-top barrier */

#pragma unroll 1
    for (int buf = 0; k < cnt; k += stride, buf ^= 1) {
        const int64_t nnit = item_at(k + 2 * stride);
        const fq_chunk_info cnn = fq_wy_item_chunk(args, nnit, items); /* used two items on */
        fq_bf16 *Ks = (fq_bf16 *)(smem + (buf ? SM::off_k1 : SM::off_k0));
        fq_bf16 *Vs = (fq_bf16 *)(smem + (buf ? SM::off_v1 : SM::off_v0));

        __syncthreads(); /* the previous item is done with Lf, Af, vec and buffer buf ^ 1 */
        int *sfi = sf + 2 * buf;
        if (tid == 0) sf[2 * (buf ^ 1)] = sf[2 * (buf ^ 1) + 1] = 64; /* the next item's slot */
        if (cn.seq >= 0)
            fq_wy_issue_loads<K, V, UO>(args, cn, (int)(nit % HV), (fq_bf16 *)(smem + (buf ? SM::off_k0 : SM::off_k1)),
                               (fq_bf16 *)(smem + (buf ? SM::off_v0 : SM::off_v1)));
        fq_cp_async_commit();

        /* gamma = cumsum(g') (warp 0: tokens lane and lane + 32; g' and tg:
         * causality, the header), beta, rk and the W column factors fw = beta
         * e^gamma rk; then the next item's gates */
        if (warp == 0) {
            const int tg = fq_wy_gates_finite(gv);
            if (lane == 0) sf[4] = tg;
            fq_wy_gate_scan(gv, bv, rv, gam, bet, rkv, fw, lane);
            fq_wy_gates(args, cn, (int)(nit % HV), gv, bv, rv);
        }
        fq_cp_async_wait<1>(); /* this item's group (all but the newest) */
        if (UO && ci.seq >= 0) fq_wy_scan_rows<V, SM::LDV>(Vs, tid, sfi + 1); /* this thread's own V pieces */
        __syncthreads();

        if (ci.seq >= 0) { /* block-uniform */
            fq_wy_lower<K, SM::LDK>(Ks, Lf, gam, bet, rkv, warp, gq, tq, sfi); /* L (as blocked) */
            __syncthreads();

            fq_wy_diag_inverse(Lf, Af, warp, lane); /* D_w = (I + L_ww)^-1 */
            __syncthreads();

#define FQ_WY3_BLK(base, i, k) ((base) + 16 * (i) * LDF + 16 * (k)) /* block (i, k) of a 64x64 fp32 tile */
            /* A_10 = -D_1 (L_10 D_0) (warp 0), A_32 = -D_3 (L_32 D_2) (warp 1);
             * scratch: Lf blocks (0, 1) and (2, 3) */
            if (warp < 2) {
                const int p = 2 * warp; /* 0 or 2 */
                float *T = FQ_WY3_BLK(Lf, p, p + 1);
                fq_wy_blk_product(T, 1.f, FQ_WY3_BLK(Lf, p + 1, p), FQ_WY3_BLK(Af, p, p), NULL, NULL);
                __syncwarp();
                fq_wy_blk_product(FQ_WY3_BLK(Af, p + 1, p), -1.f, FQ_WY3_BLK(Af, p + 1, p + 1), T, NULL, NULL);
            }
            __syncthreads();
            /* T_ij = sum_k L_ik Inv0_kj, warp w: i = 2 + w / 2, j = w % 2, into
             * Lf block (i - 2, j + 2) */
            {
                const int i = 2 + (warp >> 1), jc = warp & 1;
                float *T = FQ_WY3_BLK(Lf, i - 2, jc + 2);
                if (jc == 0)
                    fq_wy_blk_product(T, 1.f, FQ_WY3_BLK(Lf, i, 0), FQ_WY3_BLK(Af, 0, 0), FQ_WY3_BLK(Lf, i, 1),
                               FQ_WY3_BLK(Af, 1, 0));
                else
                    fq_wy_blk_product(T, 1.f, FQ_WY3_BLK(Lf, i, 1), FQ_WY3_BLK(Af, 1, 1), NULL, NULL);
            }
            __syncthreads();
            /* A_2j = -D_2 T_2j, A_3j = -(A_32 T_2j + D_3 T_3j) */
            {
                const int i = 2 + (warp >> 1), jc = warp & 1;
                const float *T2 = FQ_WY3_BLK(Lf, 0, jc + 2), *T3 = FQ_WY3_BLK(Lf, 1, jc + 2);
                if (i == 2)
                    fq_wy_blk_product(FQ_WY3_BLK(Af, 2, jc), -1.f, FQ_WY3_BLK(Af, 2, 2), T2, NULL, NULL);
                else
                    fq_wy_blk_product(FQ_WY3_BLK(Af, 3, jc), -1.f, FQ_WY3_BLK(Af, 3, 2), T2, FQ_WY3_BLK(Af, 3, 3), T3);
            }
#undef FQ_WY3_BLK
            __syncthreads();

            /* causality, rare: K rows, fw from fl on; V rows, beta from f on (as blocked;
             * without U fv stays 64: f = fl) */
            const int fl = sfi[0], f = min(fl, sfi[1]);
            if (f < 64) {
                fq_wy_cut<K, SM::LDK>(Ks, fw, fl, tid);
                if (UO) fq_wy_cut<V, SM::LDV>(Vs, bet, f, tid);
                __syncthreads();
            }
            /* W = (A diag(fw)) K, U = (A diag(beta)) V: warp w, columns w*K/4.. (as blocked);
             * AG: no W (nothing reads it there; args.w may be NULL: its memory is bwd_local's) */
            const int64_t tile = it * 64; /* (chunk * HV + j) * 64 */
            if (!AG) fq_wy_apply<K / 4>(Af, fw, Ks, SM::LDK, warp * (K / 4), args.w + tile * K, K);
            if (UO) fq_wy_apply<V / 4>(Af, bet, Vs, SM::LDV, warp * (V / 4), args.u + tile * V, V);
            fq_wy_store(args, tile, Af, gam, rkv, ci.len, f, tid);
            /* causality, rare: W's rows from min(fl, tg) on to NaN (the header) */
            const int fwn = min(fl, sf[4]);
            if (aflag && tid == 0) aflag[it] = fwn < ci.len;
            if (!AG && fwn < 64) {
                __syncthreads();
                fq_wy_poison_w<K>(args.w + tile * K, fwn, ci.len, tid);
            }
        }
        ci = cn;
        cn = cnn;
        it = nit;
        nit = nnit;
    }
    fq_cp_async_wait<0>(); /* nothing left in flight at exit */
}

template <int K, int V, bool UO, bool AG>
static fq_status fq_launch_wy_persistent(const fq_wy_args &args, int64_t items, int *aflag, cudaStream_t stream)
{
    int bytes = fq_wy_persistent_smem<K, V, UO>::bytes;
    int dev = 0, sms = 0, per_sm = 0, optin = 0;
    FQ_CUDA_CHECK(cudaGetDevice(&dev));
    FQ_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    if (optin < bytes) {
        if (AG) return fq_fail(FQ_ERR_UNSUPPORTED, "the backward's stage A with a given A needs %d bytes of shared memory per block", bytes);
        return fq_launch_wy_blocked<K, V>(args, items, stream); /* small-smem GPUs: the blocked kernel */
    }
    fq_status st = fq_cuda_set_smem((const void *)fq_fwd_wy_persistent_kernel<K, V, UO, AG>, bytes);
    if (st != FQ_OK) return st;
    FQ_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    FQ_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fq_fwd_wy_persistent_kernel<K, V, UO, AG>, 128, bytes));
    if (per_sm < 1) per_sm = 1;
    int64_t blocks = (int64_t)sms * per_sm;
    if (blocks > items) blocks = items;
    if (blocks < 1) blocks = 1;
    fq_fwd_wy_persistent_kernel<K, V, UO, AG><<<(unsigned)blocks, 128, bytes, stream>>>(args, items, aflag);
    FQ_CUDA_CHECK_LAUNCH();
    return FQ_OK;
}

template <bool UO, bool AG>
static fq_status fq_wy_persistent_dims(const fq_gdn_params *p, const fq_wy_args &args, int64_t items, int *aflag,
                                       cudaStream_t stream)
{
    if (p->K == 128 && p->V == 128) return fq_launch_wy_persistent<128, 128, UO, AG>(args, items, aflag, stream);
    if (p->K == 128 && p->V == 64) return fq_launch_wy_persistent<128, 64, UO, AG>(args, items, aflag, stream);
    if (p->K == 64 && p->V == 128) return fq_launch_wy_persistent<64, 128, UO, AG>(args, items, aflag, stream);
    if (p->K == 64 && p->V == 64) return fq_launch_wy_persistent<64, 64, UO, AG>(args, items, aflag, stream);
    if (!AG && p->K == 256 && p->V == 256) /* issue 7 item 4 (the fused recompute, AG, runs only where K, V <= 128) */
        return fq_launch_wy_persistent<256, 256, UO, false>(args, items, aflag, stream);
    return fq_cuda_head_dims_unsupported(p);
}

extern "C" fq_status fq_cuda_fwd_wy_persistent(const fq_gdn_params *p, const fq_fwd_ws *ws, int with_u, cudaStream_t stream)
{
    int64_t items = ws->nc_max * p->HV;
    if (items <= 0) return FQ_OK;
    const fq_wy_args args = fq_wy_args_of(p, ws);
    return with_u ? fq_wy_persistent_dims<true, false>(p, args, items, ws->aflag, stream)
                  : fq_wy_persistent_dims<false, false>(p, args, items, ws->aflag, stream);
}

/* The backward's fused recompute after its stage A ran with ws->abwd (= ws->a)
 * and ws->aflag (where bwd_state90 runs, which never reads W): stage A wrote
 * A, gamma and kdecay of every item and listed the items holding a
 * non-finite input (ws->aflag[items] of them from ws->aflag + items + 1);
 * those get A, gamma, kdecay again by the backward's rules (no W), and
 * aflag = 1 only if W's rows are NaN before the chunk's end (the persistent
 * kernel's mode AG; nothing to do without non-finite inputs). */
extern "C" fq_status fq_cuda_fwd_wy_given(const fq_gdn_params *p, const fq_fwd_ws *ws, cudaStream_t stream)
{
    int64_t items = ws->nc_max * p->HV;
    if (items <= 0) return FQ_OK;
    if (!ws->aflag || ws->abwd != ws->a) return fq_fail(FQ_ERR_VALUE, "internal: stage A's flags and A missing");
    const fq_wy_args args = fq_wy_args_of(p, ws);
    return fq_wy_persistent_dims<false, true>(p, args, items, ws->aflag, stream);
}

/* ------------------------------------------------------------- inverse ----
 *
 * fq_fwd_inverse_kernel: stage A of the fused sm_90a forward
 * (gdn_cuda_fwd_fused.cu), which forms W, U itself: per (chunk, value head)
 * only
 *
 *     gamma = cumsum(g),  L = strict_lower(diag(beta rk) (K K^T ⊙ Gamma) diag(rk))
 *     A     = (I + L)^-1, stored as A'' = A diag(beta)   bf16, its blocks on and below the
 *             diagonal packed by K-step (FQ_APACK_BYTES, gdn_cuda_common.cuh)
 *     rec   = the gate record (FQ_REC_*: gamma, the row and column factors,
 *             beta, e^{gamma_C}) the fused kernel reads
 *
 * Causality (issue 9): f = the chunk's first row r whose L entries c <= r
 * are not all finite (a non-finite k_r, g_r, beta_r shows there, and a
 * non-finite k_c in column c of every later row; 64: none). The non-finite
 * entries of L are zeroed by a select, so A stays finite and its rows r < f,
 * which hold none, are exact; columns c >= f of A'' and of the column factors
 * are zero; the record poisons what depends on rows >= f: qg_r = NaN (those
 * o rows come out NaN), e^{gamma_C} = NaN (the state after the chunk, hence
 * every later token), f in FQ_REC_F (the fused kernel zeroes those rows of
 * its Q, K, V tiles, so that no product meets a NaN through a structural
 * zero). An output then depends only on tokens at or before it.
 *
 * Everything stays in registers and tensor cores (the blocked and persistent kernels above solve the
 * off-diagonal blocks in fp32 FFMA from shared memory, warp 0 doing most of
 * them): warp w holds block row w of L as mma.sync accumulators (rows
 * 16w..16w+15), and A is built by the 2x2 block rule
 * [P 0; Q R]^-1 = [P^-1 0; -R^-1 Q P^-1  R^-1] at 32 and then 64 rows:
 *
 *   D_w  = (I + L_ww)^-1                   every warp, fp32 forward substitution (lanes = columns)
 *   A_10 = -D_1 (L_10 D_0)                 warp 1    } level 1
 *   A_32 = -D_3 (L_32 D_2)                 warp 3    }
 *   T_w  = [L_w0 L_w1] Inv0, Inv0 = [D_0 0; A_10 D_1]        warps 2, 3 } level 2
 *   A_2j = -D_2 T_2j,  A_3j = -(A_32 T_2j + D_3 T_3j)       (j = 0, 1) }
 *
 * The block products take bf16 operands and accumulate in fp32 (the
 * numerics were simulated against the float64 reference before this was
 * written: dev/cuda/sim_fwd_fused_numerics.py, +1 % on the forward's error).
 *
 * GVA: K K^T depends only on the q/k head, so a block takes key items
 * (chunk, q/k head) and runs the R = HV / H value heads of one after another
 * on one K K^T (formed once, each warp's block row then kept as fp32
 * fragments in the place of the K tile); the gating of L onwards is per value
 * head. Shared memory (55 KB at K = 128 and 55 KB at K = 64 with the
 * fragments' own 16 KB, 4 blocks per SM): the K tiles
 * (double-buffered: the next key item's loads in flight), the diagonal
 * blocks in fp32, A in bf16 (upper blocks zero, so block products may run
 * over them), one bf16 scratch tile per warp for the right factor of its
 * products. */
template <int K> struct fq_inv_smem {
    static constexpr int LDK = K + 8, LDA = 72, LDX = 40, LDD = 20;
    static constexpr int off_k = 0;                     /* K tiles, double-buffered */
    static constexpr int off_k1 = off_k + 64 * LDK * 2;
    static constexpr int off_a = off_k1 + 64 * LDK * 2;
    static constexpr int off_x = off_a + 64 * LDA * 2;
    static constexpr int off_d = off_x + 4 * 16 * LDX * 2;
    /* two sets of the item vectors gamma, beta, rk, rq (64 floats each): the
     * current item's, and the next one's, which warp 0 forms meanwhile */
    static constexpr int off_vec = off_d + 4 * 16 * LDD * 4;
    static constexpr int vec_floats = 4 * 64;
    /* per warp w: its block row's non-finite rows (16 bits), in the padding of
     * its diagonal block (row 0, columns 16.. of Ld's block w: never written else) */
    static __host__ __device__ constexpr int bad_word(int w) { return w * 16 * LDD + 16; }
    /* the four block rows of K K^T as fp32 fragments (16 KB): in the place of
     * the K tile they come from once it is read (K = 128), else their own */
    static constexpr int kkt_bytes = 4 * 8 * 32 * 16;
    static constexpr bool kkt_in_k = kkt_bytes <= 64 * LDK * 2;
    static constexpr int off_kkt = off_vec + 2 * vec_floats * 4;
    static constexpr int bytes = off_kkt + (kkt_in_k ? 0 : kkt_bytes);
};
/* one worker's share of a block of several (its K tiles keep their 16-byte alignment) */
template <int K> static __host__ __device__ constexpr int fq_inv_worker_bytes() { return (fq_inv_smem<K>::bytes + 127) / 128 * 128; }
static_assert(fq_inv_smem<128>::bytes + 1024 <= 233472 / 4 && fq_inv_smem<64>::bytes + 1024 <= 233472 / 4,
              "four stage A workers per SM");


/* d (+)= a b for a 16x16 left factor a (A fragment) and the 16 x 8n right
 * factor at (k0, n0) of a bf16 [k][n] tile (ld elements): NB8 n8 blocks. */
template <int NB8>
static __device__ __forceinline__ void fq_inv_mm(float (*d)[4], const uint32_t a[4], const fq_bf16 *s, int ld, int k0,
                                                 int n0)
{
#pragma unroll
    for (int n2 = 0; n2 < NB8 / 2; n2++) {
        uint32_t b[4];
        fq_frag_b_kn(b, s, ld, k0, n0 + 16 * n2);
        fq_mma_bf16(d[2 * n2], a, b[0], b[1]);
        fq_mma_bf16(d[2 * n2 + 1], a, b[2], b[3]);
    }
}

/* C fragments of two n8 blocks (16 x 16) -> the bf16 A fragment, times s. */
static __device__ __forceinline__ void fq_inv_c2a(uint32_t a[4], const float (*c)[4], float s)
{
    a[0] = fq_pack_bf16(s * c[0][0], s * c[0][1]);
    a[1] = fq_pack_bf16(s * c[0][2], s * c[0][3]);
    a[2] = fq_pack_bf16(s * c[1][0], s * c[1][1]);
    a[3] = fq_pack_bf16(s * c[1][2], s * c[1][3]);
}

/* Column block b (n8 blocks 2b, 2b+1) of a warp's block row, b chosen at run
 * time without indexing registers dynamically (which would put l in local
 * memory). */
static __device__ __forceinline__ void fq_inv_pick(float (*out)[4], const float (*l)[4], int b)
{
#pragma unroll
    for (int n = 0; n < 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            if ((n >> 1) == b) out[n & 1][e] = l[n][e];
}

/* C fragments of NB8 n8 blocks (16 rows) -> bf16 tile rows 0..15 at column c0. */
template <int NB8>
static __device__ __forceinline__ void fq_inv_store_c(fq_bf16 *s, int ld, int c0, const float (*c)[4], float sc)
{
    const int lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int n = 0; n < NB8; n++) {
        *(uint32_t *)(s + gq * ld + c0 + 8 * n + 2 * tq) = fq_pack_bf16(sc * c[n][0], sc * c[n][1]);
        *(uint32_t *)(s + (gq + 8) * ld + c0 + 8 * n + 2 * tq) = fq_pack_bf16(sc * c[n][2], sc * c[n][3]);
    }
}

/* The next item's per-token inputs, loaded a whole item ahead into
 * registers of warp 0 as they are stored (no conversion, clamp or select
 * that would wait on the load here; fq_inv_gate_scan does those): g and beta
 * of value head j, rk and rq of q/k head j / R, tokens lane and lane + 32 of
 * chunk c (flags: which are loaded). A float64 gate is converted at the load. */
struct fq_inv_raw {
    uint32_t g[2], b[2];
    float rk[2], rq[2];
    int ok[2];
};
static __device__ __forceinline__ uint32_t fq_inv_ld_raw(const void *p, fq_dtype dt, int64_t i)
{
    switch (dt) {
    case FQ_F32: return ((const uint32_t *)p)[i];
    case FQ_F16:
    case FQ_BF16: return ((const unsigned short *)p)[i];
    default: return __float_as_uint((float)((const double *)p)[i]);
    }
}
static __device__ __forceinline__ float fq_inv_raw_f(uint32_t u, fq_dtype dt)
{
    switch (dt) {
    case FQ_F16: return __half2float(__ushort_as_half((unsigned short)u));
    case FQ_BF16: return __bfloat162float(__ushort_as_bfloat16((unsigned short)u));
    default: return __uint_as_float(u); /* float32 (float64: converted at the load) */
    }
}
static __device__ __forceinline__ void fq_inv_gates(const fq_wy_args &args, fq_chunk_info c, int j, int hq,
                                                    fq_inv_raw &x)
{
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int r = lane + 32 * h;
        x.ok[h] = c.seq >= 0 && r < c.len;
        x.g[h] = x.b[h] = 0u;
        x.rk[h] = x.rq[h] = 1.f;
        if (x.ok[h]) {
            const int64_t gi = (int64_t)(c.row0 + r) * args.HV + j, qi = (int64_t)(c.row0 + r) * args.H + hq;
            x.g[h] = fq_inv_ld_raw(args.g, args.gate_dtype, gi);
            x.b[h] = fq_inv_ld_raw(args.beta, args.gate_dtype, gi);
            if (args.rk) x.rk[h] = args.rk[qi];
            if (args.rq) x.rq[h] = args.rq[qi];
        }
    }
}
/* gamma = cumsum(g) (g through the full-reset clamp, fq_gate_clamp), and
 * the vectors beta, rk, rq of the item into shared memory (zeros past len);
 * one warp, tokens lane and lane + 32 */
static __device__ __forceinline__ void fq_inv_gate_scan(const fq_inv_raw &x, fq_dtype dt, float *gam, float *bet,
                                                        float *rkv, float *rqv, int lane)
{
    float gv[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const float g = fq_inv_raw_f(x.g[h], dt);
        gv[h] = x.ok[h] ? fq_gate_clamp(g) : 0.f;
    }
    fq_warp_cumsum64(gv, lane);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int r = lane + 32 * h;
        gam[r] = gv[h];
        bet[r] = x.ok[h] ? fq_inv_raw_f(x.b[h], dt) : 0.f;
        rkv[r] = x.ok[h] ? x.rk[h] : 0.f;
        rqv[r] = x.ok[h] ? x.rq[h] : 0.f;
    }
}

/* L's block row W (warp W's, in mma accumulators l[n], n8 block n; l holds
 * K K^T's block row on entry) in its common case: every entry c <= r
 * finite. The same arithmetic as fq_inv_item's general form (the same bits),
 * with which entries enter L known at compile time outside the diagonal 16 x 16
 * block and no causality bookkeeping: chk = sum of x * 0 over the entries
 * c <= r stays exactly 0 when all are finite (a non-finite x makes it NaN).
 * Returns that test; where it fails, the caller forms the row again by the
 * general form (from kkt), which zeroes and reports the bad entries. */
template <int W>
static __device__ __forceinline__ int fq_inv_l_fast(float (*l)[4], const float *bet, const float *rkv, const float *gam,
                                                    int gq, int tq)
{
    const float L2E = 1.4426950408889634f;
    float fr[2], gr[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int r = 16 * W + gq + 8 * h;
        fr[h] = bet[r] * rkv[r];
        gr[h] = gam[r] * L2E;
    }
    float chk = 0.f;
#pragma unroll
    for (int n = 0; n < 2 * W + 2; n++) { /* (blocks above the row's diagonal stay zero) */
        const int c0 = 8 * n + 2 * tq;
        const float k0 = rkv[c0], k1 = rkv[c0 + 1], g0 = gam[c0] * L2E, g1 = gam[c0 + 1] * L2E;
        const bool diag = (n >> 1) == W;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int h = e >> 1, odd = e & 1;
            if (diag && (n & 1) && h == 0) { /* columns 16 W + 8.., rows 16 W + gq: above the diagonal */
                l[n][e] = 0.f;
                continue;
            }
            const float x = fr[h] * (odd ? k1 : k0) * exp2f(gr[h] - (odd ? g1 : g0)) * l[n][e];
            if (!diag || !(n & 1)) {
                if (!diag || h == 1) { /* below the diagonal 8 x 8 blocks: c < r */
                    chk = fmaf(x, 0.f, chk);
                    l[n][e] = x;
                    continue;
                }
            }
            /* the diagonal 8 x 8 blocks (n even, h = 0; n odd, h = 1): column 2 tq + odd
             * against row gq of the block */
            const int cc = 2 * tq + odd;
            chk = cc <= gq ? fmaf(x, 0.f, chk) : chk;
            l[n][e] = cc < gq ? x : 0.f;
        }
    }
    return chk == 0.f;
}

/* The barrier of one stage A worker: its 128 threads (a block of G workers,
 * worker w = threadIdx.x / 128, meets at named barrier 1 + w; G = 1: the
 * whole block). */
template <int G>
static __device__ __forceinline__ void fq_inv_sync(void)
{
    if (G == 1) __syncthreads();
    else asm volatile("bar.sync %0, 128;\n" ::"r"(1 + (int)(threadIdx.x >> 7)) : "memory");
}

/* One item (chunk, value head j): the warp's block row of K K^T (kkt, this
 * warp's fragments), gate vectors and A (its blocks above the diagonal zero)
 * in shared memory, the 128 threads of one worker.
 * Writes A'' and the record of `item` (and, beside the state pass, sets its
 * ready flag once both are written). */
template <int K, int G, int BWD, class Hook>
static __device__ __forceinline__ void fq_inv_item(const fq_wy_args &args, fq_chunk_info ci, int hq, int64_t item,
                                                   const float4 *kkt, fq_bf16 *Ab, fq_bf16 *Xs, float *Ld,
                                                   const float *gam, const float *bet, const float *rkv,
                                                   const float *rqv, int *ready, fq_bf16 *abwd, int *aflag,
                                                   int *acount, Hook next_gates)
{
    typedef fq_inv_smem<K> SM;
    /* f = the first bad row (64: none), from the warps' words (written
     * before the barrier after the diagonal solves) */
    auto first_bad = [&]() {
        const uint32_t *sb = (const uint32_t *)Ld;
        const unsigned long long m = (unsigned long long)sb[SM::bad_word(0)] |
                                     (unsigned long long)sb[SM::bad_word(1)] << 16 |
                                     (unsigned long long)sb[SM::bad_word(2)] << 32 |
                                     (unsigned long long)sb[SM::bad_word(3)] << 48;
        return m ? __ffsll((long long)m) - 1 : 64;
    };
    /* SIDE (lone workers): warps 0 and 1 do the item's side work in level 2,
     * where they would wait; beside the state pass (G > 1) the flow of
     * before: the record after A'', the gate scan at the item's start
     * (there the faster side-work flow made the whole forward 2-4 % slower,
     * benchmarks/NOTES.md, session 12) */
    constexpr bool SIDE = G == 1;
    /* the gate record's row r (f: the first bad row) */
    auto record_row = [&](int r, int f1) {
        const float rq = rqv[r];
        float *rec = args.rec + item * FQ_REC_FLOATS;
        const float ga = gam[r], eg = __expf(ga), rk = rkv[r];
        rec[FQ_REC_G2 + r] = ga * 1.4426950408889634f;
        rec[FQ_REC_RK + r] = rk;
        rec[FQ_REC_PRQ + r] = args.scale * rq;
        const float nan = __int_as_float(0x7fc00000);
        const int ok = r < f1; /* rows from f on: no column factor, NaN row factor for o */
        rec[FQ_REC_FA1 + r] = ok ? eg * rk : 0.f;
        rec[FQ_REC_QG + r] = ok ? args.scale * eg * rq : nan;
        rec[FQ_REC_KD + r] = ok ? __expf(gam[63] - ga) * rk : 0.f;
        rec[FQ_REC_BETA + r] = ok ? bet[r] : 0.f;
        if (r < 4)
            rec[FQ_REC_EC + r] = r == 0 ? (f1 < 64 ? nan : __expf(gam[63])) : r == 1 ? (float)f1 : 0.f;
    };

    const int tid = G > 1 ? threadIdx.x & 127 : threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gq = lane >> 2, tq = lane & 3;
    /* L = strict_lower(diag(beta rk) (K K^T ⊙ Gamma) diag(rk)): warp w's block
     * row, column blocks 0..w, in mma accumulators l[n] (n8 block n) */
    float l[8][4];
#pragma unroll
    for (int n = 0; n < 8; n++) {
        const float4 x = kkt[32 * n + lane];
        l[n][0] = x.x, l[n][1] = x.y, l[n][2] = x.z, l[n][3] = x.w;
    }
    int fast;
    switch (warp) {
    case 0: fast = fq_inv_l_fast<0>(l, bet, rkv, gam, gq, tq); break;
    case 1: fast = fq_inv_l_fast<1>(l, bet, rkv, gam, gq, tq); break;
    case 2: fast = fq_inv_l_fast<2>(l, bet, rkv, gam, gq, tq); break;
    default: fast = fq_inv_l_fast<3>(l, bet, rkv, gam, gq, tq); break;
    }
    if (__all_sync(0xffffffffu, fast)) {
        if (lane == 0) ((uint32_t *)Ld)[SM::bad_word(warp)] = 0u; /* no bad row */
    } else {
        /* the general form, from K K^T again */
#pragma unroll
        for (int n = 0; n < 8; n++) {
            const float4 x = kkt[32 * n + lane];
            l[n][0] = x.x, l[n][1] = x.y, l[n][2] = x.z, l[n][3] = x.w;
        }
        /* the row factors beta_r rk_r and gamma_r of this thread's rows, then
         * column block by column block (blocks above warp w's are all zero;
         * only the diagonal one needs the c < r mask).
         * Causality (the header): a row is bad when one of its entries c <= r
         * is not finite (a non-finite k_r or k_c, gamma, beta all show there,
         * the diagonal included); such entries are zeroed (a select), so L,
         * hence A, stays finite, and the rows before the first bad one are
         * untouched (none of their entries is bad) */
        const float L2E = 1.4426950408889634f;
        float fr[2], gr[2];
        int bad[2] = {0, 0};
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = 16 * warp + gq + 8 * h;
            fr[h] = bet[r] * rkv[r];
            gr[h] = gam[r] * L2E;
        }
#pragma unroll
        for (int n = 0; n < 8; n++) {
            if ((n >> 1) > warp) continue; /* warp-uniform; l[n] stays zero */
            const int c0 = 8 * n + 2 * tq;
            const float k0 = rkv[c0], k1 = rkv[c0 + 1], g0 = gam[c0] * L2E, g1 = gam[c0 + 1] * L2E;
            const int diag = (n >> 1) == warp;
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int h = e >> 1, r = 16 * warp + gq + 8 * h, c = c0 + (e & 1);
                const float x = fr[h] * ((e & 1) ? k1 : k0) * exp2f(gr[h] - ((e & 1) ? g1 : g0)) * l[n][e];
                const int fin = isfinite(x);
                if (!diag || c <= r) bad[h] |= !fin;
                l[n][e] = (!diag || c < r) && fin ? x : 0.f;
            }
        }
        /* the warp's bad rows 16 w + gq + 8 h as 16 bits (the 4 lanes of a row or'ed) */
        const uint32_t b0 = __ballot_sync(0xffffffffu, bad[0]), b1 = __ballot_sync(0xffffffffu, bad[1]);
        if (lane == 0) {
            uint32_t m = 0;
#pragma unroll
            for (int q = 0; q < 8; q++) m |= (((b0 >> (4 * q)) & 15u) ? 1u : 0u) << q | (((b1 >> (4 * q)) & 15u) ? 1u : 0u) << (q + 8);
            ((uint32_t *)Ld)[SM::bad_word(warp)] = m; /* read after the barriers below */
        }
    }

    /* D_w = (I + L_ww)^-1 by its 8 x 8 blocks: D_w = [[D0, 0], [X, D1]] with
     * D_b = (I + L_bb)^-1 (L_bb: the diagonal 8 x 8 blocks of L_ww) and
     * X = -D1 (L_10 D0). Step 1, lanes 8 b + c (c < 8): column c of D_b,
     *   D_b[i][c] = delta_ic - sum_{j<i} L_bb[i][j] D_b[j][c];
     * step 2, all lanes, column c = lane % 8, rows i = lane / 8 and + 4:
     *   Y[i][c] = sum_j L_10[i][j] D0[j][c],  X[i][c] = -sum_k D1[i][k] Y[k][c]
     * (the zeros of D0, D1 above their diagonals are exact, so the sums run
     * over all 8 terms). L_ww in fp32 at Lw, D0 / D1 and Y in fp32 in the
     * warp's scratch tile (free until level 1 below); D_w in bf16 into A (its
     * upper right 8 x 8 block is never written: zero from the start). */
    float *Lw = Ld + warp * 16 * SM::LDD;
    {
        float lw[2][4];
        fq_inv_pick(lw, l, warp);
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int hr = 0; hr < 2; hr++) {
                float *dst = Lw + (gq + 8 * hr) * SM::LDD + 8 * h + 2 * tq;
                dst[0] = lw[h][2 * hr];
                dst[1] = lw[h][2 * hr + 1];
            }
    }
    __syncwarp();
    {
        float *Dw = (float *)(Xs + warp * 16 * SM::LDX); /* [16][16] D0, D1; then Y [8][8] at 256 */
        static_assert(16 * SM::LDX * 2 >= (256 + 64) * 4, "D_w's blocks and Y fit the warp's scratch");
        fq_bf16 *Aw = Ab + 16 * warp * SM::LDA + 16 * warp;
        const int c = lane & 7;
        if (lane < 16) {
            const int b8 = 8 * (lane >> 3);
            float x[8];
#pragma unroll
            for (int i = 0; i < 8; i++) {
                float s0 = (i == c) ? 1.f : 0.f, s1 = 0.f;
#pragma unroll
                for (int j = 0; j < i; j++) {
                    if (j & 1) s1 -= Lw[(b8 + i) * SM::LDD + b8 + j] * x[j];
                    else s0 -= Lw[(b8 + i) * SM::LDD + b8 + j] * x[j];
                }
                x[i] = s0 + s1;
            }
#pragma unroll
            for (int i = 0; i < 8; i++) {
                Dw[(b8 + i) * 16 + b8 + c] = x[i];
                Aw[(b8 + i) * SM::LDA + b8 + c] = __float2bfloat16_rn(x[i]);
            }
        }
        __syncwarp();
        const int i0 = lane >> 3;
        float y[2] = {0.f, 0.f};
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const float d = Dw[j * 16 + c];
#pragma unroll
            for (int q = 0; q < 2; q++) y[q] += Lw[(8 + i0 + 4 * q) * SM::LDD + j] * d;
        }
#pragma unroll
        for (int q = 0; q < 2; q++) Dw[256 + (i0 + 4 * q) * 8 + c] = y[q];
        __syncwarp();
        float xo[2] = {0.f, 0.f};
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const float yk = Dw[256 + k * 8 + c];
#pragma unroll
            for (int q = 0; q < 2; q++) xo[q] -= Dw[(8 + i0 + 4 * q) * 16 + 8 + k] * yk;
        }
#pragma unroll
        for (int q = 0; q < 2; q++) Aw[(8 + i0 + 4 * q) * SM::LDA + c] = __float2bfloat16_rn(xo[q]);
    }
    fq_inv_sync<G>();

    /* level 1: A_w,w-1 = -D_w (L_w,w-1 D_w-1), warps 1 and 3 */
    float a32[2][4]; /* warp 3: A_32 */
    fq_bf16 *Xw = Xs + warp * 16 * SM::LDX;
    if (warp & 1) {
        float x[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        uint32_t a[4];
        float lb[2][4];
        fq_inv_pick(lb, l, warp - 1);
        fq_inv_c2a(a, lb, 1.f);
        fq_inv_mm<2>(x, a, Ab, SM::LDA, 16 * (warp - 1), 16 * (warp - 1));
        fq_inv_store_c<2>(Xw, SM::LDX, 0, x, 1.f);
        __syncwarp();
        float y[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        fq_frag_a(a, Ab, SM::LDA, 16 * warp, 16 * warp);
        fq_inv_mm<2>(y, a, Xw, SM::LDX, 0, 0);
        fq_inv_store_c<2>(Ab + 16 * warp * SM::LDA, SM::LDA, 16 * (warp - 1), y, -1.f);
#pragma unroll
        for (int n = 0; n < 2; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) a32[n][e] = -y[n][e];
    }
    fq_inv_sync<G>();

    /* level 2: T_w = [L_w0 L_w1] Inv0 (Inv0 = A[0:32, 0:32], upper block zero),
     * then A_2. = -D_2 T_2 (warp 2), A_3. = -(A_32 T_2 + D_3 T_3) (warp 3) */
    if (warp >= 2) {
        float t[4][4];
#pragma unroll
        for (int n = 0; n < 4; n++) t[n][0] = t[n][1] = t[n][2] = t[n][3] = 0.f;
#pragma unroll
        for (int kb = 0; kb < 2; kb++) {
            uint32_t a[4];
            fq_inv_c2a(a, &l[2 * kb], 1.f);
            fq_inv_mm<4>(t, a, Ab, SM::LDA, 16 * kb, 0);
        }
        fq_inv_store_c<4>(Xw, SM::LDX, 0, t, 1.f);
    } else if (SIDE && warp == 0) {
        next_gates(); /* the next item's gate scan (the other vector set), the one after's gate loads */
    } else if (SIDE) {
        /* warp 1: the gate record, rows lane and lane + 32 */
        const int f1 = first_bad();
#pragma unroll
        for (int h = 0; h < 2; h++) record_row(lane + 32 * h, f1);
    }
    /* T_2 (warp 2's scratch) visible to warp 3: the worker's barrier (warps 0
     * and 1 have only their side work here; a named barrier of warps 2 and 3
     * alone made racecheck misorder the items of a block) */
    fq_inv_sync<G>();
    if (warp >= 2) {
        const fq_bf16 *X2 = Xs + 2 * 16 * SM::LDX;
        float y[4][4];
#pragma unroll
        for (int n = 0; n < 4; n++) y[n][0] = y[n][1] = y[n][2] = y[n][3] = 0.f;
        uint32_t a[4];
        fq_frag_a(a, Ab, SM::LDA, 16 * warp, 16 * warp);
        fq_inv_mm<4>(y, a, Xw, SM::LDX, 0, 0); /* D_w T_w */
        if (warp == 3) {
            fq_inv_c2a(a, a32, 1.f);
            fq_inv_mm<4>(y, a, X2, SM::LDX, 0, 0); /* + A_32 T_2 */
        }
        fq_inv_store_c<4>(Ab + 16 * warp * SM::LDA, SM::LDA, 0, y, -1.f);
    }
    fq_inv_sync<G>();

    /* f = the first bad row (64: none): columns c >= f of A'' are zero, the
     * record poisons rows r >= f (the header) */
    const int f = first_bad();
    /* A'' = A diag(beta) (bf16; stored: its blocks on and below the diagonal,
     * FQ_APACK_BYTES, gdn_cuda_common.cuh) and the gate record. By 16-byte
     * piece p of the stored tile, so that a warp writes 512 contiguous bytes:
     * K-step kk, piece q of it = row r, columns c..c+7 (core q / 8 = row group
     * 2 kk + q / 16, half (q / 8) % 2; row q % 8 of the core). beta of the
     * columns only where c < f (a select: A's columns from f on are zeros even
     * where they overflowed). */
    {
        /* piece p = tid + 128 i (i = 0, 1, 2; the third only for tid < 64): the
         * loop unrolled, each piece's K-step known from i up to one compare,
         * and each piece one 16-byte store */
        static_assert(FQ_APACK_BYTES / 16 == 320, "A'' packed: 320 pieces of 16 bytes");
        fq_bf16 *ag = args.a + item * FQ_APACK_ELEMS;
#pragma unroll
        for (int i = 0; i < 3; i++) {
            const int p = tid + 128 * i;
            if (i == 2 && p >= FQ_APACK_BYTES / 16) break;
            const int kk = i == 0 ? 0 : i == 1 ? (p < 224 ? 1 : 2) : (p < 288 ? 2 : 3);
            const int q = p - fq_apack_step_bytes(kk) / 16;
            const int r = 16 * kk + 8 * (q >> 4) + (q & 7), c = 16 * kk + 8 * ((q >> 3) & 1);
            const uint4 x = *(const uint4 *)(Ab + r * SM::LDA + c);
            const uint32_t px[4] = {x.x, x.y, x.z, x.w};
            const float4 b0 = *(const float4 *)(bet + c), b1 = *(const float4 *)(bet + c + 4);
            const float bc[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
            uint32_t o[4];
            if (f == 64) { /* (block-uniform: no bad row, the common case) */
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float2 y = fq_unpack_bf16(px[e]);
                    o[e] = fq_pack_bf16(y.x * bc[2 * e], y.y * bc[2 * e + 1]);
                }
            } else {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float2 y = fq_unpack_bf16(px[e]);
                    o[e] = fq_pack_bf16(c + 2 * e < f ? y.x * bc[2 * e] : 0.f, c + 2 * e + 1 < f ? y.y * bc[2 * e + 1] : 0.f);
                }
            }
            *(uint4 *)(ag + 8 * p) = make_uint4(o[0], o[1], o[2], o[3]);
        }
    }
    if (!SIDE && tid < 64) record_row(tid, f);
    if (BWD) {
        /* the backward's A (bf16 [64][64], zeros above the diagonal: Ab's
         * blocks there were never written) for bwd_wy, gamma and kdecay, and
         * whether the item holds a non-finite input (f < 64: a bad k, g, beta
         * or rk shows in L, fq_fwd_inverse_kernel's header), where the
         * backward's own rules differ (g' = finite select): such items are
         * listed (acount[0] of them at acount + 1) and
         * fq_fwd_wy_persistent_kernel's mode AG forms them again */
        fq_bf16 *ag = abwd + item * 64 * 64;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int p = tid + 128 * i, r = p >> 3, c = 8 * (p & 7);
            *(uint4 *)(ag + r * 64 + c) = *(const uint4 *)(Ab + r * SM::LDA + c);
        }
        if (tid < 64) { /* gamma and kdecay as the persistent kernel's (fq_wy_store; the
                           flagged items get theirs again by the backward's rules) */
            args.gamma[item * 64 + tid] = gam[tid];
            args.kdecay[item * 64 + tid] = tid < ci.len ? __expf(gam[63] - gam[tid]) * rkv[tid] : 0.f;
        }
        if (tid == 0) {
            const int bad = f < 64 || !isfinite(gam[63]);
            aflag[item] = bad;
            if (bad) acount[1 + atomicAdd(acount, 1)] = (int)item; /* (the list's order does not matter) */
        }
    }
    if (G > 1 && ready) { /* beside the state pass: every thread's stores of A'' and the record, then the flag */
        fq_inv_sync<G>();
        if (tid == 0) fq_flag_publish(ready + item);
    }
}

/* Persistent: grid min(kitems, SMs x 4) workers of 128 threads (G per block:
 * 1, or 4 beside the state pass, so that a block fills an SM and leaves the
 * others to the state pass) loop over the key items
 * ki = (chunk, q/k head hq) = worker, worker + workers, ...; each
 * key item is R = HV / H items (chunk, value head j = hq R + i), i = 0..R-1,
 * that share its K tile and K K^T (GVA): the tile is loaded once (cp.async,
 * double-buffered: the next key item's is in flight meanwhile), K K^T formed
 * once into shared memory (each warp its own block row), and per value head
 * only the gates, L, the inverse and the stores differ. Lone workers (G = 1):
 * warps 0 and 1, idle in level 2 of the inverse, do the item's serial side
 * work there: warp 0 the next item's gate scan (into the other of two vector
 * sets) and the loads of the gates after it, warp 1 this item's gate record;
 * so an item starts with one barrier and L at once. Beside the state pass
 * (G = 4) warp 0 scans at the item's start while the others wait and the
 * record follows A'' (the lone flow made the forward slower there:
 * benchmarks/NOTES.md, session 12). The chunk table is read two key items
 * ahead. */
template <int K, int G, int BWD>
__global__ void __launch_bounds__(128 * G, 4 / G) fq_fwd_inverse_kernel(fq_wy_args args, int kitems, int *ready,
                                                                        fq_bf16 *abwd, int *aflag)
{
    typedef fq_inv_smem<K> SM;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char *smem = smem_raw; /* this worker's */
    if (G > 1) smem += (threadIdx.x >> 7) * fq_inv_worker_bytes<K>();
    fq_bf16 *Ab = (fq_bf16 *)(smem + SM::off_a);
    fq_bf16 *Xs = (fq_bf16 *)(smem + SM::off_x);
    float *Ld = (float *)(smem + SM::off_d);
    float *vecs = (float *)(smem + SM::off_vec); /* two sets [gamma | beta | rk | rq], 64 floats each */
    const int HV = args.HV, H = args.H, R = HV / H;
    const int tid = G > 1 ? threadIdx.x & 127 : threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int stride = gridDim.x * G;
    if (G > 1 && ready) {
        /* beside the state pass: it launches once every block has started (so
         * that every worker it waits for is resident) and the kernels before
         * this one have completed (it reads their outputs without a wait) */
        fq_pdl_wait();
        fq_pdl_trigger();
    } else {
        fq_pdl_trigger();
        fq_pdl_wait();
    }
    /* A starts as zeros; every item writes all of its blocks on and below the
     * diagonal, so the blocks above it stay zero */
    for (int idx = tid; idx < 64 * SM::LDA / 8; idx += 128) ((uint4 *)Ab)[idx] = make_uint4(0, 0, 0, 0);

    auto chunk_of = [&](int k) {
        fq_chunk_info c;
        if (k < kitems) {
            c = args.chunks[k / H];
        } else {
            c.seq = -1;
            c.row0 = c.len = c.local = 0;
        }
        return c;
    };
    /* the K rows of chunk c, q/k head hq (zeros past len) into buffer b; no commit */
    auto issue = [&](fq_chunk_info c, int hq, int b) {
        if (c.seq >= 0)
            fq_wy_load_rows<K, SM::LDK>((fq_bf16 *)(smem + (b ? SM::off_k1 : SM::off_k)), args.kb, H, hq, c, tid);
    };
    /* the chunk table is read two key items ahead. The gates: warp 0 scans
     * item n + 1's (raw, loaded an item ago, into the other vector set) and
     * loads item n + 2's, while the other warps compute item n's level 2
     * (G = 1) or at item n's start (G = 4; next_gates below): items run in
     * the order (key item, value head) and alternate between the two sets. */
    int ki = blockIdx.x * G + (G > 1 ? threadIdx.x >> 7 : 0), hq = ki % H;
    fq_chunk_info ci = chunk_of(ki), cn = chunk_of(ki + stride);
    issue(ci, hq, 0);
    fq_cp_async_commit();
    fq_inv_raw gx;
    /* the raw gates of the item i2 places after value head i of key item ki
     * (into gx; warp 0) */
    auto load_ahead = [&](int i, int i2, const fq_chunk_info &c0, const fq_chunk_info &c1, const fq_chunk_info &c2,
                          int h0, int h1, int h2) {
        int j = i + i2, kk = 0;
        while (j >= R) j -= R, kk++;
        const fq_chunk_info &c = kk == 0 ? c0 : kk == 1 ? c1 : c2;
        const int h = kk == 0 ? h0 : kk == 1 ? h1 : h2;
        fq_inv_gates(args, c, h * R + j, h, gx);
    };
    int vs = 0; /* the vector set of the current item */
    if (warp == 0) {
        fq_inv_gates(args, ci, hq * R, hq, gx);
        fq_inv_gate_scan(gx, args.gate_dtype, vecs, vecs + 64, vecs + 128, vecs + 192, lane);
        load_ahead(0, 1, ci, cn, cn, hq, (ki + stride) % H, (ki + stride) % H);
    }
#pragma unroll 1
    for (int buf = 0; ki < kitems; ki += stride, buf ^= 1) {
        const int nki = ki + stride, nhq = nki % H, nnhq = (nki + stride) % H;
        const fq_chunk_info cnn = chunk_of(nki + stride); /* used from the next key item on */
        const int64_t item0 = (int64_t)(ki / H) * HV + hq * R; /* (chunk, value head hq R) */
#pragma unroll 1
        for (int i = 0; i < R; i++, vs ^= 1) {
            /* the previous item is done with A, the scratch, its vector set
             * and buffer buf ^ 1; this item's vector set (scanned by warp 0
             * during the previous item) and, i = 0, this key item's K tile
             * (the only group in flight) are visible after the barrier */
            if (i == 0) fq_cp_async_wait<0>();
            fq_inv_sync<G>();
            if (i == 0) {
                issue(cn, nhq, buf ^ 1);
                fq_cp_async_commit();
            }
            const float *gam = vecs + vs * SM::vec_floats;
            float *nvec = vecs + (vs ^ 1) * SM::vec_floats;
            auto next_gates = [&]() {
                fq_inv_gate_scan(gx, args.gate_dtype, nvec, nvec + 64, nvec + 128, nvec + 192, lane);
                load_ahead(i, 2, ci, cn, cnn, hq, nhq, nnhq);
            };
            if (G > 1 || ci.seq < 0) { /* (ci.seq < 0: block-uniform) */
                if (warp == 0) next_gates();
                if (ci.seq < 0) continue;
                fq_inv_sync<G>(); /* (G > 1: as before the side-work flow, every warp waits for the scan) */
            }
            /* this key item's K K^T: warp w's block row as fp32 fragments (K = 128: in place of the K tile) */
            float4 *kkt = (float4 *)(smem + (!SM::kkt_in_k ? SM::off_kkt : buf ? SM::off_k1 : SM::off_k)) + warp * 8 * 32;
            if (i == 0) {
                /* K K^T once per key item, warp w its block row */
                const fq_bf16 *Ks = (const fq_bf16 *)(smem + (buf ? SM::off_k1 : SM::off_k));
                float l[8][4];
                switch (warp) {
                case 0: fq_kkt_block_row<K, SM::LDK, 0>(l, Ks, 0); break;
                case 1: fq_kkt_block_row<K, SM::LDK, 1>(l, Ks, 1); break;
                case 2: fq_kkt_block_row<K, SM::LDK, 2>(l, Ks, 2); break;
                default: fq_kkt_block_row<K, SM::LDK, 3>(l, Ks, 3); break;
                }
                fq_inv_sync<G>(); /* every warp is done reading the K tile (which the fragments may replace) */
#pragma unroll
                for (int n = 0; n < 8; n++) kkt[32 * n + lane] = make_float4(l[n][0], l[n][1], l[n][2], l[n][3]);
                /* (each lane reads back only what it wrote) */
            }
            fq_inv_item<K, G, BWD>(args, ci, hq, item0 + i, kkt, Ab, Xs, Ld, gam, gam + 64, gam + 128, gam + 192,
                                   ready, abwd, aflag, BWD ? aflag + (int64_t)kitems * R : (int *)NULL, next_gates);
        }
        ci = cn;
        cn = cnn;
        hq = nhq;
    }
    fq_cp_async_wait<0>(); /* nothing left in flight at exit */
}

/* beside: that many blocks of 4 workers (fq_cuda_fwd_beside), one per SM by
 * their shared memory; 0: blocks of one worker, as many as fit. BWD (the
 * backward's recompute): also the backward's A and the items' flags. */
template <int K, int BWD>
static fq_status fq_launch_inverse(const fq_wy_args &args, int kitems, int beside, int *ready, fq_bf16 *abwd,
                                   int *aflag, cudaStream_t stream)
{
    if (beside > 0) {
        const int bytes = 4 * fq_inv_worker_bytes<K>();
        fq_status st = fq_cuda_set_smem((const void *)fq_fwd_inverse_kernel<K, 4, BWD>, bytes);
        if (st != FQ_OK) return st;
        int grid = beside;
        if ((int64_t)grid * 4 > kitems) grid = (kitems + 3) / 4;
        return fq_launch_k(fq_fwd_inverse_kernel<K, 4, BWD>, (unsigned)grid, 512, bytes, stream,
                           fq_cuda_pdl_enabled(), args, kitems, ready, abwd, aflag);
    }
    int bytes = fq_inv_smem<K>::bytes;
    fq_status st = fq_cuda_set_smem((const void *)fq_fwd_inverse_kernel<K, 1, BWD>, bytes);
    if (st != FQ_OK) return st;
    int dev = 0, sms = 0, per_sm = 0;
    FQ_CUDA_CHECK(cudaGetDevice(&dev));
    FQ_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    FQ_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fq_fwd_inverse_kernel<K, 1, BWD>, 128, bytes));
    if (per_sm < 1) per_sm = 1;
    int grid = sms * per_sm;
    if (grid > kitems) grid = kitems;
    return fq_launch_k(fq_fwd_inverse_kernel<K, 1, BWD>, (unsigned)grid, 128, bytes, stream, fq_cuda_pdl_enabled(),
                       args, kitems, (int *)NULL, abwd, aflag);
}

extern "C" fq_status fq_cuda_fwd_inverse(const fq_gdn_params *p, const fq_fwd_ws *ws, int beside,
                                         cudaStream_t stream)
{
    /* key items (chunk, q/k head); int indices in the kernel: kitems + its grid < 2^31 */
    const int64_t kitems = ws->nc_max * p->H;
    if (kitems <= 0) return FQ_OK;
    if (kitems > (1LL << 30))
        return fq_fail(FQ_ERR_VALUE, "too many chunks for the CUDA forward (%lld chunks x %lld heads)",
                       (long long)ws->nc_max, (long long)p->H);
    fq_wy_args args = fq_wy_args_of(p, ws);
    args.rec = ws->rec;
    int *ready = beside > 0 ? ws->ready : NULL; /* (a kernel argument of its own: in fq_wy_args it changed the code) */
    const int bwd = ws->abwd != NULL;
    if (p->K == 128)
        return bwd ? fq_launch_inverse<128, 1>(args, (int)kitems, beside, ready, ws->abwd, ws->aflag, stream)
                   : fq_launch_inverse<128, 0>(args, (int)kitems, beside, ready, NULL, NULL, stream);
    if (p->K == 64)
        return bwd ? fq_launch_inverse<64, 1>(args, (int)kitems, beside, ready, ws->abwd, ws->aflag, stream)
                   : fq_launch_inverse<64, 0>(args, (int)kitems, beside, ready, NULL, NULL, stream);
    return fq_cuda_head_dims_unsupported(p);
}

/* ------------------------------------------------------- dispatchers ----
 * The three-stage forward runs the blocked kernel: on the H200 the persistent
 * one made the whole forward 4-8% slower (benchmarks/NOTES.md, "Stage A v3",
 * the persistent kernel's first name). */
extern "C" fq_status fq_cuda_fwd_wy(const fq_gdn_params *p, const fq_fwd_ws *ws, cudaStream_t stream)
{
    return fq_cuda_fwd_wy_blocked(p, ws, stream);
}

/* The backward's recompute runs the persistent kernel: the backward rows of
 * benchmarks/results were measured with it; the blocked one there is not. */
extern "C" fq_status fq_cuda_fwd_wy_recompute(const fq_gdn_params *p, const fq_fwd_ws *ws, int with_u,
                                              cudaStream_t stream)
{
    return fq_cuda_fwd_wy_persistent(p, ws, with_u, stream);
}
