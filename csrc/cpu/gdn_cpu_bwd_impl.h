/*
 * gdn_cpu_bwd_impl.h — the body of the CPU chunked backward, written once for
 * a real type and included twice by gdn_cpu_bwd.c:
 *
 *     #define REAL float   / #define FQ_SFX f32   (F32, F16, BF16 inputs)
 *     #define REAL double  / #define FQ_SFX f64   (F64 inputs)
 *
 * The equations are in the comment block at the top of gdn_cpu_bwd.c; every
 * step below quotes the forward line it differentiates. Row-major everywhere:
 * a chunk matrix X[r][i] of C x K is X[r * K + i]; C x C matrices use the
 * leading dimension FQ_BWD_CHUNK. Products are written as row "axpy"s
 * (y[0:n] += sum_p a[p] * B[p][0:n]) whose inner loops run over contiguous
 * memory, so the compiler vectorises them without reassociating sums; where
 * a product needs a column, the operand is transposed first (cheap: O(C K)).
 */
#ifndef REAL
#error "define REAL and FQ_SFX before including gdn_cpu_bwd_impl.h"
#endif

#define FQ_CAT2_(a, b) a##_##b
#define FQ_CAT2(a, b) FQ_CAT2_(a, b)
#define FN(name) FQ_CAT2(name, FQ_SFX)
/* the helpers: fq_cpu_<helper>_<FQ_SFX> unless the includer names them (the
 * per-instruction-set files gdn_cpu_kernels_<isa>.c name their own) */
#ifndef FQ_LOAD
#define FQ_LOAD FQ_CAT2(fq_cpu_load, FQ_SFX)
#define FQ_STORE FQ_CAT2(fq_cpu_store, FQ_SFX)
#define FQ_L2NORM FQ_CAT2(fq_cpu_l2norm, FQ_SFX)
#define FQ_GEMM FQ_CAT2(fq_cpu_gemm, FQ_SFX)
#define FQ_TRMM_LOWER FQ_CAT2(fq_cpu_trmm_lower, FQ_SFX)
#define FQ_TRMM_UPPER FQ_CAT2(fq_cpu_trmm_upper, FQ_SFX)
#endif

#define CH FQ_BWD_CHUNK

/* Per-thread scratch: the chunk-start states of one value head, the dq/dk
 * accumulators of one (sequence, q/k head) and the chunk-sized buffers. */
typedef struct {
    REAL *states;           /* [max_chunks][K][V]: S at the start of each chunk */
    REAL *vns;              /* [max_chunks][C][V]: Vn of each chunk (pass 1)    */
    REAL *accq, *acck;      /* [Tmax][K] dq_hat, dk_hat summed over the group (mode A) */
    REAL *S, *dS, *dSp;     /* [K][V] state, dL/dS' (carry), dL/dS (new carry)   */
    REAL *St, *dSt;         /* [V][K] transposes of S and dS'                   */
    REAL *Q, *Kc, *Qt, *Kt; /* [C][K] (normalised) q, k rows; [K][C] transposes  */
    REAL *Kb, *KbT, *W, *Wt;/* diag(b e^gam) K, W = A Kb and transposes          */
    REAL *dQ, *dK, *dW, *dKb;
    REAL *Vc, *dO, *Vb, *VbT, *Vn, *VnT, *dVn, *dVb; /* [C][V] and [V][C]        */
    REAL *Gam, *KK, *Lm, *Am, *At, *P, *Pt, *dP, *Mt, *dA, *T1, *dL; /* [C][C] */
    REAL *eg, *kd, *bc, *gc, *dgam, *tk, *db; /* [C]                             */
    REAL *rowK, *rowK2, *tmp; /* [max(K, V, C)]                                  */
    double gamd[CH];          /* gam in double: gam_r - gam_s stays exact-ish      */
    int seg[CH];              /* seg[r]: the last full reset at or before row r (-1) */
} FN(bwd_ws);

/* Number of REAL elements one thread's scratch needs (each buffer rounded up
 * to 16 elements so every buffer stays 64-byte aligned). */
/* Number of REAL elements one thread's scratch needs (each buffer rounded up
 * to 16 elements so every buffer stays 64-byte aligned). Computed in double
 * so that the caller can refuse sizes that do not fit a size_t. */
static double FN(bwd_ws_elems)(int64_t K, int64_t V, int64_t max_chunks, int64_t Tacc)
{
#define R16(x) (16.0 * ceil((double)(x) / 16.0))
    const double KV = R16((double)K * V), CK = R16(CH * K), CV = R16(CH * V), CC = R16(CH * CH);
    const double mx = R16(K > V ? (K > CH ? K : CH) : (V > CH ? V : CH));
    return (double)max_chunks * (KV + CV) + 2 * R16((double)Tacc * K) + 5 * KV + 12 * CK +
           8 * CV + 12 * CC + 8 * R16(CH) + 3 * mx;
#undef R16
}

static void FN(bwd_ws_carve)(FN(bwd_ws) *w, REAL *base, int64_t K, int64_t V,
                             int64_t max_chunks, int64_t Tacc)
{
#define TAKE(ptr, n) do { (ptr) = base; base += ((((size_t)(n)) + 15u) & ~(size_t)15u); } while (0)
    int64_t mx = K > V ? (K > CH ? K : CH) : (V > CH ? V : CH);
    base += 0;
    w->states = base;
    base += (size_t)max_chunks * ((((size_t)(K * V)) + 15u) & ~(size_t)15u);
    w->vns = base;
    base += (size_t)max_chunks * ((((size_t)(CH * V)) + 15u) & ~(size_t)15u);
    TAKE(w->accq, Tacc * K); TAKE(w->acck, Tacc * K);
    TAKE(w->S, K * V); TAKE(w->dS, K * V); TAKE(w->dSp, K * V);
    TAKE(w->St, K * V); TAKE(w->dSt, K * V);
    TAKE(w->Q, CH * K); TAKE(w->Kc, CH * K); TAKE(w->Qt, CH * K); TAKE(w->Kt, CH * K);
    TAKE(w->Kb, CH * K); TAKE(w->KbT, CH * K); TAKE(w->W, CH * K); TAKE(w->Wt, CH * K);
    TAKE(w->dQ, CH * K); TAKE(w->dK, CH * K); TAKE(w->dW, CH * K); TAKE(w->dKb, CH * K);
    TAKE(w->Vc, CH * V); TAKE(w->dO, CH * V); TAKE(w->Vb, CH * V); TAKE(w->VbT, CH * V);
    TAKE(w->Vn, CH * V); TAKE(w->VnT, CH * V); TAKE(w->dVn, CH * V); TAKE(w->dVb, CH * V);
    TAKE(w->Gam, CH * CH); TAKE(w->KK, CH * CH); TAKE(w->Lm, CH * CH); TAKE(w->Am, CH * CH);
    TAKE(w->At, CH * CH); TAKE(w->P, CH * CH); TAKE(w->Pt, CH * CH); TAKE(w->dP, CH * CH);
    TAKE(w->Mt, CH * CH); TAKE(w->dA, CH * CH); TAKE(w->T1, CH * CH); TAKE(w->dL, CH * CH);
    TAKE(w->eg, CH); TAKE(w->kd, CH); TAKE(w->bc, CH);
    TAKE(w->gc, CH); TAKE(w->dgam, CH); TAKE(w->tk, CH); TAKE(w->db, CH);
    TAKE(w->rowK, mx); TAKE(w->rowK2, mx); TAKE(w->tmp, mx);
#undef TAKE
}

/* ------------------------------------------------------- small kernels ---- */

/* y[0:n] += sum_{p0 <= p < p1} a[p] * B[p][0:n]   (B row stride ldb) */
static inline void FN(row_axpy)(REAL *restrict y, const REAL *restrict a, const REAL *restrict B,
                                int64_t ldb, int64_t p0, int64_t p1, int64_t n)
{
    const int64_t np = p1 - p0, n4 = np > 0 ? np & ~(int64_t)3 : 0;
    for (int64_t q = 0; q < n4; q += 4) {
        const int64_t p = p0 + q;
        const REAL a0 = a[p], a1 = a[p + 1], a2 = a[p + 2], a3 = a[p + 3];
        const REAL *restrict b0 = B + p * ldb;
        const REAL *restrict b1 = b0 + ldb;
        const REAL *restrict b2 = b1 + ldb;
        const REAL *restrict b3 = b2 + ldb;
        for (int64_t j = 0; j < n; j++) y[j] += a0 * b0[j] + a1 * b1[j] + a2 * b2[j] + a3 * b3[j];
    }
    for (int64_t q = n4; q < np; q++) {
        const int64_t p = p0 + q;
        const REAL a0 = a[p];
        const REAL *restrict b0 = B + p * ldb;
        for (int64_t j = 0; j < n; j++) y[j] += a0 * b0[j];
    }
}

/* y[s] += sum_{m < p1} a[m] * B[m][s] over the lower triangle s <= m only
 * (B lower-triangular: its zeros above the diagonal are never multiplied, so a
 * NaN in a[m] stays out of y[s] for s > m). Rows m0..m0+3 share s <= m0. */
static inline void FN(row_axpy_lower)(REAL *restrict y, const REAL *restrict a,
                                      const REAL *restrict B, int64_t ldb, int64_t p1)
{
    int64_t m0 = 0;
    for (; m0 + 4 <= p1; m0 += 4) {
        const REAL a0 = a[m0], a1 = a[m0 + 1], a2 = a[m0 + 2], a3 = a[m0 + 3];
        const REAL *restrict b0 = B + m0 * ldb;
        const REAL *restrict b1 = b0 + ldb;
        const REAL *restrict b2 = b1 + ldb;
        const REAL *restrict b3 = b2 + ldb;
        for (int64_t s = 0; s <= m0; s++) y[s] += a0 * b0[s] + a1 * b1[s] + a2 * b2[s] + a3 * b3[s];
        y[m0 + 1] += a1 * b1[m0 + 1] + a2 * b2[m0 + 1] + a3 * b3[m0 + 1];
        y[m0 + 2] += a2 * b2[m0 + 2] + a3 * b3[m0 + 2];
        y[m0 + 3] += a3 * b3[m0 + 3];
    }
    for (int64_t m = m0; m < p1; m++) {
        const REAL am = a[m];
        const REAL *restrict bm = B + m * ldb;
        for (int64_t s = 0; s <= m; s++) y[s] += am * bm[s];
    }
}

/* y[s] += sum_{m < p1} a[m] * B[m][s] over the upper triangle m <= s < n only
 * (B upper-triangular; as above). Rows m0..m0+3 share s >= m0 + 3. */
static inline void FN(row_axpy_upper)(REAL *restrict y, const REAL *restrict a,
                                      const REAL *restrict B, int64_t ldb, int64_t p1, int64_t n)
{
    int64_t m0 = 0;
    for (; m0 + 4 <= p1 && m0 + 3 < n; m0 += 4) {
        const REAL a0 = a[m0], a1 = a[m0 + 1], a2 = a[m0 + 2], a3 = a[m0 + 3];
        const REAL *restrict b0 = B + m0 * ldb;
        const REAL *restrict b1 = b0 + ldb;
        const REAL *restrict b2 = b1 + ldb;
        const REAL *restrict b3 = b2 + ldb;
        y[m0] += a0 * b0[m0];
        y[m0 + 1] += a0 * b0[m0 + 1] + a1 * b1[m0 + 1];
        y[m0 + 2] += a0 * b0[m0 + 2] + a1 * b1[m0 + 2] + a2 * b2[m0 + 2];
        for (int64_t s = m0 + 3; s < n; s++) y[s] += a0 * b0[s] + a1 * b1[s] + a2 * b2[s] + a3 * b3[s];
    }
    for (int64_t m = m0; m < p1; m++) {
        const REAL am = a[m];
        const REAL *restrict bm = B + m * ldb;
        for (int64_t s = m; s < n; s++) y[s] += am * bm[s];
    }
}

/* a . b with 16 partial sums (vectorises; the order of the sum differs from
 * a plain loop, which the tests allow) */
static inline REAL FN(dot)(const REAL *restrict a, const REAL *restrict b, int64_t n)
{
    REAL part[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) part[l] += a[i + l] * b[i + l];
    REAL s = 0;
    for (; i < n; i++) s += a[i] * b[i];
    for (int l = 0; l < 16; l++) s += part[l];
    return s;
}

static inline void FN(zero)(REAL *x, int64_t n)
{
    for (int64_t i = 0; i < n; i++) x[i] = 0;
}

/* dst[j][i] = src[i][j] for i < rows, j < cols  (src stride lds, dst stride
 * ldd), in 16 x 16 blocks so that the strided side stays in L1 */
static void FN(transpose)(REAL *restrict dst, int64_t ldd, const REAL *restrict src, int64_t lds,
                          int64_t rows, int64_t cols)
{
    for (int64_t i0 = 0; i0 < rows; i0 += 16) {
        const int64_t i1 = i0 + 16 < rows ? i0 + 16 : rows;
        for (int64_t j0 = 0; j0 < cols; j0 += 16) {
            const int64_t j1 = j0 + 16 < cols ? j0 + 16 : cols;
#if defined(FQ_BWD_REAL_IS_F32) && defined(FQ_BWD_HAVE_TRANSPOSE16_F32)
            if (i1 - i0 == 16 && j1 - j0 == 16) {
                fq_bwd_transpose16_f32(dst + j0 * ldd + i0, ldd, src + i0 * lds + j0, lds);
                continue;
            }
#endif
            for (int64_t j = j0; j < j1; j++)
                for (int64_t i = i0; i < i1; i++) dst[j * ldd + i] = src[i * lds + j];
        }
    }
}

/* 1 / sqrt(sum x^2 + eps), summed in the same order as fq_cpu_l2norm_*. */
static inline REAL FN(l2_inv)(const REAL *x, int64_t n)
{
    REAL ss = 0;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    return (REAL)1 / (REAL)sqrt((double)(ss + (REAL)FQ_L2NORM_EPS));
}

/* ------------------------------------------------------------- stages ---- */

/* Load the rows of one chunk: k (and q) of q/k head h, v (and do), g, beta of
 * value head j; tokens tok0 .. tok0+c-1 (flat token index row*T + t). Then
 * gam = chunk-local cumsum(g), e^gam, e^(gam_C - gam), and the transposes. */
static void FN(load_chunk)(const fq_gdn_params *p, FN(bwd_ws) *w, int64_t tok0, int64_t c,
                           int64_t h, int64_t j, int with_q_do)
{
    const int64_t K = p->K, V = p->V, H = p->H, HV = p->HV;
    for (int64_t r = 0; r < c; r++) {
        const int64_t tok = tok0 + r;
        FQ_LOAD(w->Kc + r * K, p->k, p->dtype, (tok * H + h) * K, K);
        if (p->use_qk_l2norm) FQ_L2NORM(w->Kc + r * K, K);
        FQ_LOAD(w->Vc + r * V, p->v, p->dtype, (tok * HV + j) * V, V);
        if (with_q_do) {
            FQ_LOAD(w->Q + r * K, p->q, p->dtype, (tok * H + h) * K, K);
            if (p->use_qk_l2norm) FQ_L2NORM(w->Q + r * K, K);
            FQ_LOAD(w->dO + r * V, p->dout, p->dtype, (tok * HV + j) * V, V);
        }
        w->gc[r] = (REAL)fq_cpu_gate_g(p, tok * HV + j, j); /* fused gates applied */
        w->bc[r] = (REAL)fq_cpu_gate_beta(p, tok * HV + j);
    }
    /* gam_r = sum_{s <= r} g_s, kept in double even for float: with strong
     * decay gam reaches ~ -1e3 within a chunk, and a float gam_r - gam_s
     * would lose ~1e-4 of the exponent. The sum restarts after each full
     * reset g <= FQ_GATE_RESET (gdn.h): e^gam_r = 0 after a reset in 0..r,
     * e^(gC - gam_r) = 0 with a reset in r+1..c-1, never -inf - -inf. */
    for (int64_t r = 0; r < c; r++) w->gamd[r] = (double)w->gc[r];
    fq_cpu_gate_scan(w->gamd, w->seg, c);
    const double gC = w->gamd[c - 1];
    const int sC = w->seg[c - 1];
    for (int64_t r = 0; r < c; r++) {
        w->eg[r] = w->seg[r] < 0 ? (REAL)exp(w->gamd[r]) : (REAL)0;
        w->kd[r] = w->seg[r] == sC ? (REAL)exp(gC - w->gamd[r]) : (REAL)0;
    }
    FN(transpose)(w->Kt, CH, w->Kc, K, c, K);
    if (with_q_do) FN(transpose)(w->Qt, CH, w->Q, K, c, K);
}

/* Everything of the chunk that does not depend on the state:
 *   Gam_rs = exp(gam_r - gam_s) (r >= s, else 0), KK = K K^T (strict lower),
 *   L = strict_lower(diag(b)(K K^T o Gam)), A = (I + L)^-1,
 *   Kbn = -diag(b e^gam) K, Vb = diag(b) V, Wn = A Kbn = -W, U = A Vb (into Vn;
 *   pass 1 only: pass 2 reads the Vn that pass 1 kept).
 * W and Kb are kept negated so that every product below is C = s C + A B. */
static void FN(chunk_local)(const fq_gdn_params *p, FN(bwd_ws) *w, int64_t c, int with_u)
{
    const int64_t K = p->K, V = p->V;
    for (int64_t r = 0; r < c; r++) {
        REAL *gr = w->Gam + r * CH;
        const double gr_ = w->gamd[r];
        const int sr = w->seg[r];
        for (int64_t s = 0; s <= r; s++) { /* 0 across a full reset */
            const REAL e = FQ_EXP((REAL)(gr_ - w->gamd[s]));
            gr[s] = w->seg[s] == sr ? e : (REAL)0;
        }
        for (int64_t s = r + 1; s < c; s++) gr[s] = 0;
    }
    /* KK[r][s] = k_r . k_s (s < r used);  L[r][s] = b_r KK[r][s] Gam[r][s] */
    FQ_GEMM(c, c, K, w->Kc, K, w->Kt, CH, w->KK, CH, 0, 0, FQ_TRI_N);
    for (int64_t r = 0; r < c; r++) {
        REAL *l = w->Lm + r * CH;
        const REAL *kk = w->KK + r * CH, *gr = w->Gam + r * CH;
        for (int64_t s = 0; s < r; s++) l[s] = w->bc[r] * kk[s] * gr[s];
        for (int64_t s = r; s < c; s++) l[s] = 0;
    }
    /* A = (I + L)^-1 by forward substitution: A[r] = e_r - sum_{m<r} L[r][m] A[m],
     * each A[m] only over its columns 0..m (A is lower-triangular: L[r][m] never
     * meets the zeros of A[m], so a NaN in L[r][m] stays out of A[r][s] for
     * s > m, which do not depend on token m) */
    for (int64_t r = 0; r < c; r++) {
        REAL *a = w->Am + r * CH;
        FN(zero)(a, c);
        FN(row_axpy_lower)(a, w->Lm + r * CH, w->Am, CH, r);
        for (int64_t s = 0; s < r; s++) a[s] = -a[s];
        a[r] = 1;
    }
    /* Kbn = -diag(b e^gam) K,  Vb = diag(b) V,  Wn = A Kbn,  U = A Vb */
    for (int64_t r = 0; r < c; r++) {
        const REAL be = -w->bc[r] * w->eg[r], b = w->bc[r];
        for (int64_t i = 0; i < K; i++) w->Kb[r * K + i] = be * w->Kc[r * K + i];
        for (int64_t i = 0; i < V; i++) w->Vb[r * V + i] = b * w->Vc[r * V + i];
    }
    FQ_TRMM_LOWER(c, K, w->Am, CH, w->Kb, K, w->W, K, 0, 0);
    if (with_u) FQ_TRMM_LOWER(c, V, w->Am, CH, w->Vb, V, w->Vn, V, 0, 0);
}

/* Vn = U - W S = U + Wn S   (U is in w->Vn already) */
static void FN(chunk_vnew)(const fq_gdn_params *p, FN(bwd_ws) *w, const REAL *S, int64_t c)
{
    FQ_GEMM(c, p->V, p->K, w->W, p->K, S, p->V, w->Vn, p->V, 1, 1, FQ_TRI_NONE);
}

/* The reverse-mode of one chunk. In: S (chunk-start state), w->dS = dL/dS'.
 * Vn = U - W S of the chunk (kept by pass 1).
 * Out: w->dSp = dL/dS, and the chunk's dQ, dK (in w->dQ, w->dK: q_hat, k_hat
 * gradients), dV (in w->dVb), dbeta (w->db), dg (w->dgam). */
static void FN(chunk_bwd)(const fq_gdn_params *p, FN(bwd_ws) *w, const REAL *S, const REAL *Vn,
                          int64_t c)
{
    const int64_t K = p->K, V = p->V;
    const REAL scale = (REAL)p->scale;
    const REAL egC = w->eg[c - 1];
    REAL *dgam = w->dgam;

    FN(chunk_local)(p, w, c, 0); /* Vn = U - W S: kept from pass 1 */
    FN(transpose)(w->St, K, S, V, K, V);        /* St = S^T    [V][K] */
    FN(transpose)(w->dSt, K, w->dS, V, K, V);   /* dSt = dS'^T [V][K] */
    FN(transpose)(w->Wt, CH, w->W, K, c, K);    /* Wt = Wn^T   [K][C] */
    FN(transpose)(w->VnT, CH, Vn, V, c, V);     /* VnT = Vn^T  [V][C] */
    FN(zero)(dgam, c);

    /* fwd: P = lower_incl(Q K^T o Gam)   (unscaled; O = scale (... + P Vn)) */
    FQ_GEMM(c, c, K, w->Q, K, w->Kt, CH, w->P, CH, 0, 0, FQ_TRI_N);
    for (int64_t r = 0; r < c; r++) {
        REAL *pr = w->P + r * CH;
        for (int64_t s = 0; s <= r; s++) pr[s] *= w->Gam[r * CH + s];
        for (int64_t s = r + 1; s < c; s++) pr[s] = 0;
    }
    FN(transpose)(w->Pt, CH, w->P, CH, c, c);   /* Pt = scale P^T (zero below the diagonal) */
    for (int64_t s = 0; s < c; s++)
        for (int64_t r = s; r < c; r++) w->Pt[s * CH + r] *= scale;

    /* fwd: O = scale (diag(e^gam) Q S + P Vn);  S' = e^gC S + K^T diag(kd) Vn
     * so:  dVn = scale P^T dO + diag(kd) K dS' */
    FQ_GEMM(c, V, K, w->Kc, K, w->dS, V, w->dVn, V, 0, 0, FQ_TRI_NONE);
    for (int64_t r = 0; r < c; r++)
        for (int64_t i = 0; i < V; i++) w->dVn[r * V + i] *= w->kd[r];
    FQ_TRMM_UPPER(c, V, w->Pt, CH, w->dO, V, w->dVn, V, 1, 1);
    /* dS = e^gC dS' + scale (diag(e^gam) Q)^T dO - W^T dVn   (the last term,
     * + Wn^T dVn, from fwd: Vn = U - W S) */
    for (int64_t i = 0; i < K; i++)              /* Qt -> scale (diag(e^gam) Q)^T */
        for (int64_t r = 0; r < c; r++) w->Qt[i * CH + r] *= scale * w->eg[r];
    memcpy(w->dSp, w->dS, (size_t)(K * V) * sizeof(REAL));
    FQ_GEMM(K, V, c, w->Qt, CH, w->dO, V, w->dSp, V, egC, 1, FQ_TRI_NONE);
    FQ_GEMM(K, V, c, w->Wt, CH, w->dVn, V, w->dSp, V, 1, 1, FQ_TRI_NONE);
    /* fwd: e^gC S in S'  ->  dgam_C += e^gC <S, dS'> */
    dgam[c - 1] += egC * FN(dot)(S, w->dS, K * V);

    /* fwd: O = scale P Vn  ->  dP = scale dO Vn^T (lower incl.) */
    FQ_GEMM(c, c, V, w->dO, V, w->VnT, CH, w->dP, CH, 0, 0, FQ_TRI_N);
    for (int64_t r = 0; r < c; r++) {
        REAL *y = w->dP + r * CH;
        for (int64_t s = 0; s <= r; s++) y[s] *= scale;
        for (int64_t s = r + 1; s < c; s++) y[s] = 0;
    }
    /* fwd: O = scale diag(e^gam) Q S  ->  dQ = scale diag(e^gam) dO S^T,
     *                                      dgam_r += e^gam_r q_r . (scale dO S^T)_r */
    FQ_GEMM(c, K, V, w->dO, V, w->St, K, w->dQ, K, 0, 0, FQ_TRI_NONE);
    for (int64_t r = 0; r < c; r++) {
        REAL *y = w->dQ + r * K;
        const REAL f = scale * w->eg[r];
        dgam[r] += f * FN(dot)(w->Q + r * K, y, K);
        for (int64_t i = 0; i < K; i++) y[i] *= f;
    }
    /* fwd: S' = ... + (diag(kd) K)^T Vn  ->  dK = diag(kd) Vn dS'^T,
     * and kd_r = exp(sum_{m>r} g_m): dg_m += sum_{r<m} t_r, t_r = kd_r k_r . (Vn dS'^T)_r */
    FQ_GEMM(c, K, V, Vn, V, w->dSt, K, w->dK, K, 0, 0, FQ_TRI_NONE);
    for (int64_t r = 0; r < c; r++) {
        REAL *y = w->dK + r * K;
        w->tk[r] = w->kd[r] * FN(dot)(w->Kc + r * K, y, K);
        for (int64_t i = 0; i < K; i++) y[i] *= w->kd[r];
    }
    /* fwd: Vn = U + Wn S  ->  dWn = dVn S^T  (dU = dVn) */
    FQ_GEMM(c, K, V, w->dVn, V, w->St, K, w->dW, K, 0, 0, FQ_TRI_NONE);

    /* fwd: P_rs = (q_r . k_s) Gam_rs  ->  with M = dP o Gam: dQ += M K, dK += M^T Q;
     * Gam_rs = exp(gam_r - gam_s) gives dgam_r += E_rs, dgam_s -= E_rs with
     * E = dP o P (off the diagonal only: Gam_rr = 1 does not depend on g);
     * E is kept in P (no longer needed) and reaches dg as a crossing sum (end) */
    for (int64_t r = 0; r < c; r++) {
        REAL *dp = w->dP + r * CH, *pr = w->P + r * CH;
        const REAL *gr = w->Gam + r * CH;
        for (int64_t s = 0; s < r; s++) pr[s] *= dp[s];  /* P -> E */
        for (int64_t s = 0; s <= r; s++) dp[s] *= gr[s]; /* dP -> M */
    }
    FN(transpose)(w->Mt, CH, w->dP, CH, c, c);              /* Mt = M^T */
    FQ_TRMM_LOWER(c, K, w->dP, CH, w->Kc, K, w->dQ, K, 1, 1);
    FQ_TRMM_UPPER(c, K, w->Mt, CH, w->Q, K, w->dK, K, 1, 1);

    /* fwd: U = A Vb, Wn = A Kbn  ->  dA = dVn Vb^T + dWn Kbn^T (its strict lower
     * part is all that reaches L), dVb = A^T dVn, dKbn = A^T dWn */
    FN(transpose)(w->VbT, CH, w->Vb, V, c, V);
    FN(transpose)(w->KbT, CH, w->Kb, K, c, K);
    FQ_GEMM(c, c, V, w->dVn, V, w->VbT, CH, w->dA, CH, 0, 0, FQ_TRI_N);
    FQ_GEMM(c, c, K, w->dW, K, w->KbT, CH, w->dA, CH, 1, 1, FQ_TRI_N);
    FN(transpose)(w->At, CH, w->Am, CH, c, c);
    FQ_TRMM_UPPER(c, V, w->At, CH, w->dVn, V, w->dVb, V, 0, 0);
    FQ_TRMM_UPPER(c, K, w->At, CH, w->dW, K, w->dKb, K, 0, 0);
    /* fwd: Vb = diag(b) V  ->  dV = diag(b) dVb, db_r = v_r . dVb_r
     * fwd: Kbn = -diag(b e^gam) K  ->  dK -= diag(b e^gam) dKbn,
     *      t2_r = e^gam_r k_r . dKb_r = -e^gam_r k_r . dKbn_r: db_r += t2_r, dgam_r += b_r t2_r */
    for (int64_t r = 0; r < c; r++) {
        REAL *dvb = w->dVb + r * V;
        w->db[r] = FN(dot)(w->Vc + r * V, dvb, V);
        for (int64_t i = 0; i < V; i++) dvb[i] *= w->bc[r]; /* dVb -> dV */
        const REAL *dkb = w->dKb + r * K;
        const REAL t2 = -w->eg[r] * FN(dot)(w->Kc + r * K, dkb, K);
        w->db[r] += t2;
        dgam[r] += w->bc[r] * t2;
        const REAL f = -w->bc[r] * w->eg[r];
        REAL *dk = w->dK + r * K;
        for (int64_t i = 0; i < K; i++) dk[i] += f * dkb[i];
    }

    /* fwd: A = (I + L)^-1  ->  dL = -strict_lower(A^T dA A^T)
     * T1 = A^T dA (columns m < row needed), dL[r][0:r] = -sum_m T1[r][m] A^T[m][0:r],
     * A^T[m][s] = A[s][m] only over s >= m (exactly triangular: see A above) */
    for (int64_t s = 0; s < c; s++) {
        REAL *y = w->T1 + s * CH;
        FN(zero)(y, c);
        FN(row_axpy)(y, w->At + s * CH, w->dA, CH, s, c, s);
    }
    for (int64_t r = 0; r < c; r++) {
        REAL *y = w->dL + r * CH;
        FN(zero)(y, c);
        FN(row_axpy_upper)(y, w->T1 + r * CH, w->At, CH, r, r);
        for (int64_t s = 0; s < r; s++) y[s] = -y[s];
    }
    /* fwd: L_rs = b_r (k_r . k_s) Gam_rs (r > s)  ->  with G = dL o Gam and
     * Bm = diag(b) G:  dK += Bm K + Bm^T K,  db_r += sum_s G_rs KK_rs,
     * E2 = dL o L: dgam_r += E2_rs, dgam_s -= E2_rs (added to E in P) */
    for (int64_t r = 0; r < c; r++) {
        REAL *y = w->dL + r * CH, *e = w->P + r * CH;
        const REAL *gr = w->Gam + r * CH, *kk = w->KK + r * CH, *l = w->Lm + r * CH;
        REAL dbr = 0;
        for (int64_t s = 0; s < r; s++) {
            const REAL G = y[s] * gr[s];
            dbr += G * kk[s];
            e[s] += y[s] * l[s];
            y[s] = w->bc[r] * G; /* dL -> Bm */
        }
        w->db[r] += dbr;
    }
    FN(transpose)(w->Mt, CH, w->dL, CH, c, c);              /* Mt = Bm^T */
    FQ_TRMM_LOWER(c, K, w->dL, CH, w->Kc, K, w->dK, K, 1, 1);
    FQ_TRMM_UPPER(c, K, w->Mt, CH, w->Kc, K, w->dK, K, 1, 1);

    /* fwd: gam = cumsum(g) in the chunk  ->  dg_m = sum_{r>=m} dgam_r.
     * The pair terms (E = E + E2 in P: +E_rs at r, -E_rs at s < r) enter as the
     * crossing sum X_m = sum_{r>=m} sum_{s<m} E_rs, their exact value: the
     * reverse cumsum of +E_rs - E_rs would cancel them in rounding (NaN - NaN
     * when a NaN at token s >= m can play no part in dg_m).
     * Column suffix sums in place: E_rs <- sum_{r'>=r} E_r's (s < r). */
    for (int64_t r = c - 2; r >= 1; r--) {
        REAL *restrict e = w->P + r * CH;
        const REAL *restrict e1 = w->P + (r + 1) * CH;
        for (int64_t s = 0; s < r; s++) e[s] += e1[s];
    }
    /* Full resets (gdn.h): gam restarts after a reset u (gam_u = 0 is no
     * function of any g), so the reverse cumsum restarts there and dg_u = 0
     * (alpha_u = 0 exactly); E_rs = 0 across a reset (Gam_rs = 0), and so is
     * t_r where kd_r = 0: the kd terms dg_m += sum_{r<m} t_r (see dK above)
     * cross no reset either. */
    REAL acc = 0;
    for (int64_t r = c - 1; r >= 0; r--) {
        if (w->seg[r] == (int)r) {
            dgam[r] = 0;
            acc = 0;
            continue;
        }
        const REAL *e = w->P + r * CH;
        REAL x = 0;
        for (int64_t s = 0; s < r; s++) x += e[s];
        acc += dgam[r];
        dgam[r] = acc + x;
    }
    acc = 0;
    for (int64_t r = 0; r < c; r++) {
        if (w->seg[r] != (int)r) dgam[r] += acc;
        acc += w->tk[r];
    }
}

/* One (sequence n, value head j): both passes over the chunks. Adds q_hat and
 * k_hat gradients to accq/acck (row t at t * ld), writes dv, dg, dbeta of the
 * value head and dh0[n, j]. With use_gate_in_kernel, gsum[0], gsum[1] get
 * this (n, j)'s sums of dL/dA_log and dL/ddt_bias over its tokens. */
static void FN(bwd_value_head)(const fq_gdn_params *p, FN(bwd_ws) *w, int64_t n, int64_t j,
                               REAL *accq, REAL *acck, int64_t ld, double *gsum)
{
    const int64_t K = p->K, V = p->V, HV = p->HV;
    const int64_t h = j / (HV / p->H);
    const int64_t KV = K * V;
    const size_t sstride = (((size_t)KV) + 15u) & ~(size_t)15u;
    const size_t vstride = (((size_t)(CH * V)) + 15u) & ~(size_t)15u;
    int64_t row, first, len;
    fq_cpu_seq_bounds(p, n, &row, &first, &len);
    const int64_t tok_base = row * p->T + first;
    const int64_t nchunks = (len + CH - 1) / CH;

    /* pass 1: S at the start of every chunk  (fwd: S' = e^gC S + K^T diag(kd) Vn) */
    if (p->h0) fq_cpu_load_state(w->S, V, p->h0, p->state_dtype, (n * HV + j) * KV, K, V, p->state_vk);
    else FN(zero)(w->S, KV);
    for (int64_t ci = 0; ci < nchunks; ci++) {
        memcpy(w->states + (size_t)ci * sstride, w->S, (size_t)KV * sizeof(REAL));
        const int64_t c = len - ci * CH < CH ? len - ci * CH : CH;
        FN(load_chunk)(p, w, tok_base + ci * CH, c, h, j, 0);
        FN(chunk_local)(p, w, c, 1);
        FN(chunk_vnew)(p, w, w->S, c);
        memcpy(w->vns + (size_t)ci * vstride, w->Vn, (size_t)(c * V) * sizeof(REAL));
        for (int64_t i = 0; i < K; i++) /* Qt -> (diag(kd) K)^T */
            for (int64_t r = 0; r < c; r++) w->Qt[i * CH + r] = w->kd[r] * w->Kt[i * CH + r];
        if (ci == nchunks - 1) break; /* the final state is not needed */
        FQ_GEMM(K, V, c, w->Qt, CH, w->Vn, V, w->S, V, w->eg[c - 1], 1, FQ_TRI_NONE);
    }

    /* pass 2: reverse over the chunks, carrying dS from dht to dh0 */
    if (p->dht) fq_cpu_load_state(w->dS, V, p->dht, p->state_dtype, (n * HV + j) * KV, K, V, p->state_vk);
    else FN(zero)(w->dS, KV);
    double sum_dA = 0, sum_ddt = 0;
    for (int64_t ci = nchunks - 1; ci >= 0; ci--) {
        const int64_t t0 = ci * CH;
        const int64_t c = len - t0 < CH ? len - t0 : CH;
        const REAL *S = w->states + (size_t)ci * sstride;
        FN(load_chunk)(p, w, tok_base + t0, c, h, j, 1);
        FN(chunk_bwd)(p, w, S, w->vns + (size_t)ci * vstride, c);
        for (int64_t r = 0; r < c; r++) {
            const int64_t tok = tok_base + t0 + r;
            FQ_STORE(p->dv, p->dtype, (tok * HV + j) * V, w->dVb + r * V, V);
            if (p->use_gate_in_kernel) {
                /* fwd: g = -exp(A_log) softplus(a + dt_bias)  ->  da = dg dg/da,
                 * dA_log += dg g, ddt_bias += da */
                const double dgr = w->dgam[r];
                const double da = dgr * fq_cpu_gate_dg_da(p, tok * HV + j, j);
                sum_dA += dgr * (double)w->gc[r];
                sum_ddt += da;
                w->dgam[r] = (REAL)da;
            }
            if (p->use_beta_sigmoid_in_kernel) /* fwd: beta = sigmoid(b)  ->  db = dbeta beta (1 - beta) */
                w->db[r] *= w->bc[r] * (1 - w->bc[r]);
            FQ_STORE(p->dg, p->gate_dtype, tok * HV + j, w->dgam + r, 1);
            FQ_STORE(p->dbeta, p->gate_dtype, tok * HV + j, w->db + r, 1);
            REAL *aq = accq + (t0 + r) * ld, *ak = acck + (t0 + r) * ld;
            const REAL *dq = w->dQ + r * K, *dk = w->dK + r * K;
            for (int64_t i = 0; i < K; i++) aq[i] += dq[i];
            for (int64_t i = 0; i < K; i++) ak[i] += dk[i];
        }
        REAL *t = w->dS; /* the new carry */
        w->dS = w->dSp;
        w->dSp = t;
    }
    if (p->dh0) fq_cpu_store_state(p->dh0, p->state_dtype, (n * HV + j) * KV, w->dS, V, K, V, p->state_vk);
    if (gsum) {
        gsum[0] = sum_dA;
        gsum[1] = sum_ddt;
    }
}

/* dq, dk of (sequence n, q/k head h) from the gradients of q_hat, k_hat summed
 * over `ng` slices (slice g of token t at acc + t * ld + g * K):
 * fwd: q_hat = q / sqrt(|q|^2 + eps)  ->  dq = (dq_hat - q_hat (q_hat . dq_hat)) / sqrt(...) */
static void FN(bwd_finish_qk)(const fq_gdn_params *p, FN(bwd_ws) *w, int64_t n, int64_t h,
                              const REAL *accq, const REAL *acck, int64_t ld, int64_t ng)
{
    const int64_t K = p->K, H = p->H;
    int64_t row, first, len;
    fq_cpu_seq_bounds(p, n, &row, &first, &len);
    const int64_t tok_base = row * p->T + first;
    for (int64_t t = 0; t < len; t++) {
        const int64_t tok = tok_base + t;
        for (int which = 0; which < 2; which++) {
            const REAL *acc = (which ? acck : accq) + t * ld;
            REAL *d = w->rowK;
            memcpy(d, acc, (size_t)K * sizeof(REAL));
            for (int64_t g = 1; g < ng; g++)
                for (int64_t i = 0; i < K; i++) d[i] += acc[g * K + i];
            if (p->use_qk_l2norm) {
                REAL *x = w->rowK2;
                FQ_LOAD(x, which ? p->k : p->q, p->dtype, (tok * H + h) * K, K);
                const REAL rn = FN(l2_inv)(x, K);
                for (int64_t i = 0; i < K; i++) x[i] *= rn;
                const REAL xd = FN(dot)(x, d, K);
                for (int64_t i = 0; i < K; i++) d[i] = (d[i] - x[i] * xd) * rn;
            }
            FQ_STORE(which ? p->dk : p->dq, p->dtype, (tok * H + h) * K, d, K);
        }
    }
}

/* ------------------------------------------------------ thread drivers ---- */

typedef struct {
    const fq_gdn_params *p;
    REAL *scratch;          /* nthreads * ws_elems */
    size_t ws_elems;
    int64_t max_chunks, Tacc;
    const int64_t *order;   /* sequences, longest first */
    REAL *gacc_q, *gacc_k;  /* mode B: [B*T][HV][K] per-value-head gradients */
    double *gsum;           /* use_gate_in_kernel: [N][HV][2] sums of dA_log, ddt_bias */
} FN(bwd_ctx);

/* this (sequence n, value head j)'s slot of cx->gsum, or NULL */
static double *FN(bwd_gsum)(FN(bwd_ctx) *cx, int64_t n, int64_t j)
{
    return cx->gsum ? cx->gsum + (n * cx->p->HV + j) * 2 : NULL;
}

static void FN(bwd_ws_for)(FN(bwd_ctx) *cx, int tid, FN(bwd_ws) *w)
{
    FN(bwd_ws_carve)(w, cx->scratch + (size_t)tid * cx->ws_elems, cx->p->K, cx->p->V,
                     cx->max_chunks, cx->Tacc);
}

/* Mode A item = (sequence, q/k head): loop the group's value heads, sum
 * their q_hat/k_hat gradients in this thread's accumulators, then finish. */
static void FN(bwd_item_qk_head)(void *ctx, int64_t item, int tid)
{
    FN(bwd_ctx) *cx = (FN(bwd_ctx) *)ctx;
    const fq_gdn_params *p = cx->p;
    const int64_t n = cx->order[item / p->H], h = item % p->H, G = p->HV / p->H;
    FN(bwd_ws) w;
    FN(bwd_ws_for)(cx, tid, &w);
    int64_t row, first, len;
    fq_cpu_seq_bounds(p, n, &row, &first, &len);
    FN(zero)(w.accq, len * p->K);
    FN(zero)(w.acck, len * p->K);
    for (int64_t j = h * G; j < (h + 1) * G; j++)
        FN(bwd_value_head)(p, &w, n, j, w.accq, w.acck, p->K, FN(bwd_gsum)(cx, n, j));
    FN(bwd_finish_qk)(p, &w, n, h, w.accq, w.acck, p->K, 1);
}

/* Mode B item = (sequence, value head): its q_hat/k_hat gradients go to the
 * global per-value-head buffers, summed afterwards by bwd_item_finish. */
static void FN(bwd_item_value_head)(void *ctx, int64_t item, int tid)
{
    FN(bwd_ctx) *cx = (FN(bwd_ctx) *)ctx;
    const fq_gdn_params *p = cx->p;
    const int64_t n = cx->order[item / p->HV], j = item % p->HV, K = p->K, HV = p->HV;
    FN(bwd_ws) w;
    FN(bwd_ws_for)(cx, tid, &w);
    int64_t row, first, len;
    fq_cpu_seq_bounds(p, n, &row, &first, &len);
    const int64_t tok_base = row * p->T + first;
    REAL *aq = cx->gacc_q + (tok_base * HV + j) * K, *ak = cx->gacc_k + (tok_base * HV + j) * K;
    for (int64_t t = 0; t < len; t++) {
        FN(zero)(aq + t * HV * K, K);
        FN(zero)(ak + t * HV * K, K);
    }
    FN(bwd_value_head)(p, &w, n, j, aq, ak, HV * K, FN(bwd_gsum)(cx, n, j));
}

static void FN(bwd_item_finish)(void *ctx, int64_t item, int tid)
{
    FN(bwd_ctx) *cx = (FN(bwd_ctx) *)ctx;
    const fq_gdn_params *p = cx->p;
    const int64_t n = cx->order[item / p->H], h = item % p->H, G = p->HV / p->H;
    const int64_t K = p->K, HV = p->HV;
    FN(bwd_ws) w;
    FN(bwd_ws_for)(cx, tid, &w);
    int64_t row, first, len;
    fq_cpu_seq_bounds(p, n, &row, &first, &len);
    const int64_t off = ((row * p->T + first) * HV + h * G) * K;
    FN(bwd_finish_qk)(p, &w, n, h, cx->gacc_q + off, cx->gacc_k + off, HV * K, G);
}

/* The whole backward for one real type. mode_b: parallelise over value heads
 * (when there are fewer (sequence, q/k head) pairs than threads). */
static fq_status FN(chunk_bwd_run)(const fq_gdn_params *p, const int64_t *order, int64_t Tmax)
{
    const int64_t H = p->H, HV = p->HV, K = p->K, V = p->V, N = p->N, G = HV / H;
    const int64_t max_chunks = (Tmax + CH - 1) / CH;
    int nt_a = fq_cpu_resolve_threads(N * H, p->num_threads);
    int nt_b = fq_cpu_resolve_threads(N * HV, p->num_threads);
    const int mode_b = G > 1 && nt_b > nt_a;
    const int nt = mode_b ? nt_b : nt_a;
    const int64_t Tacc = mode_b ? 0 : Tmax;

    /* sizes: refuse what cannot be addressed rather than overflow */
    const double ws_elems = FN(bwd_ws_elems)(K, V, max_chunks, Tacc);
    const double acc_elems = mode_b ? (double)p->B * (double)p->T * (double)HV * (double)K : 0.0;
    const double total_bytes = ((double)nt * ws_elems + 2.0 * acc_elems) * (double)sizeof(REAL);
    if (total_bytes > (double)(SIZE_MAX / 4))
        return fq_fail(FQ_ERR_NOMEM, "chunk_bwd: %.3g bytes of CPU scratch cannot be allocated",
                       total_bytes);

    FN(bwd_ctx) cx;
    memset(&cx, 0, sizeof cx);
    cx.p = p;
    cx.order = order;
    cx.max_chunks = max_chunks;
    cx.Tacc = Tacc;
    cx.ws_elems = (size_t)ws_elems;
    cx.scratch = (REAL *)aligned_alloc(64, (size_t)nt * cx.ws_elems * sizeof(REAL));
    if (!cx.scratch)
        return fq_fail(FQ_ERR_NOMEM, "chunk_bwd: cannot allocate %zu bytes of CPU scratch",
                       (size_t)nt * cx.ws_elems * sizeof(REAL));
    fq_status st = FQ_OK;
    if (p->use_gate_in_kernel) {
        cx.gsum = (double *)calloc((size_t)(N * HV * 2 > 0 ? N * HV * 2 : 1), sizeof(double));
        if (!cx.gsum) {
            st = fq_fail(FQ_ERR_NOMEM, "chunk_bwd: cannot allocate %lld gate sums", (long long)(N * HV * 2));
            goto done;
        }
    }
    if (mode_b) {
        const size_t nacc = (size_t)p->B * (size_t)p->T * (size_t)HV * (size_t)K;
        cx.gacc_q = (REAL *)malloc((nacc ? nacc : 1) * sizeof(REAL));
        cx.gacc_k = (REAL *)malloc((nacc ? nacc : 1) * sizeof(REAL));
        if (!cx.gacc_q || !cx.gacc_k) {
            st = fq_fail(FQ_ERR_NOMEM, "chunk_bwd: cannot allocate %zu bytes of CPU scratch",
                         2 * nacc * sizeof(REAL));
            goto done;
        }
        st = fq_cpu_parallel_for(N * HV, nt, FN(bwd_item_value_head), &cx);
        if (st == FQ_OK) st = fq_cpu_parallel_for(N * H, nt, FN(bwd_item_finish), &cx);
    } else {
        st = fq_cpu_parallel_for(N * H, nt, FN(bwd_item_qk_head), &cx);
    }
    /* dA_log[j], ddt_bias[j]: the per-(sequence, head) sums added in sequence
     * order, so the result does not depend on the threads */
    if (st == FQ_OK && cx.gsum)
        for (int64_t j = 0; j < HV; j++) {
            double a = 0, b = 0;
            for (int64_t n = 0; n < N; n++) {
                a += cx.gsum[(n * HV + j) * 2];
                b += cx.gsum[(n * HV + j) * 2 + 1];
            }
            if (p->dA_log) fq_cpu_store_f64(p->dA_log, p->gate_param_dtype, j, &a, 1);
            if (p->ddt_bias) fq_cpu_store_f64(p->ddt_bias, p->gate_param_dtype, j, &b, 1);
        }
done:
    free(cx.gsum);
    free(cx.gacc_q);
    free(cx.gacc_k);
    free(cx.scratch);
    return st;
}

#undef CH
#undef FQ_L2NORM
#undef FQ_GEMM
#undef FQ_TRMM_LOWER
#undef FQ_TRMM_UPPER
#undef FQ_EXP
#undef FQ_STORE
#undef FQ_LOAD
#undef FN
#undef FQ_CAT2
#undef FQ_CAT2_
