/*
 * gdn_cpu_fwd_impl.h — the CPU chunked forward for one real type. Included
 * twice by gdn_cpu_fwd.c: once with REAL = float (F32/F16/BF16 inputs), once
 * with REAL = double (F64 inputs). Expects the macros
 *
 *   REAL          float or double
 *   FQ_SFX(name)  name##_f32 or name##_f64
 *   FQ_LOAD       fq_cpu_load_f32 / fq_cpu_load_f64
 *   FQ_STORE      fq_cpu_store_f32 / fq_cpu_store_f64
 *   FQ_GEMM       fq_cpu_gemm_f32 / fq_cpu_gemm_f64
 *   FQ_TRMM_LOWER fq_cpu_trmm_lower_f32 / _f64
 *   FQ_EXP        fq_cpu_expf / exp
 *   FQ_L2NORM     fq_cpu_l2norm_f32 / fq_cpu_l2norm_f64
 *
 * and the fq_fwd_ctx struct and FQ_CHUNK of gdn_cpu_fwd.c.
 *
 * Work item = (sequence n, value head j). Its scratch (per thread, REAL):
 *
 *   Qc, Kc  [C, Kp]      the chunk's q, k rows (zero-padded to Kp columns and,
 *                        in a short last chunk, zero rows)
 *   KT      [Kp, C]      Kc transposed (B operand of K K^T and of K^T Vs)
 *   G       [2C, C]      rows 0..C-1: K K^T -> -L;  rows C..2C-1: Q K^T -> P
 *   X       [C, Kp+Vp]   [ -diag(b e^g) K | diag(b) V ]  -> solved: [ -W | U ]
 *                        -> right half becomes Vn = U - W S
 *   Vs      [C, Vp]      diag(e^{g_C - g}) Vn
 *   O       [C, Vp]      the chunk's output rows
 *   S       [Kp, Vp]     the state at the chunk's start
 *   gam, bet, eg [C]     cumulative gate, beta, e^gam
 *
 * Padding (columns K..Kp-1, V..Vp-1 and rows past the sequence end with
 * g = beta = 0) stays exactly zero through every product, so the micro-kernels
 * always see full 8 x 32 tiles, as long as the item's data is finite: a NaN
 * turns padding into NaN (0 * NaN), so with padding columns the scratch is
 * zeroed again at the start of every work item, and a NaN of one (sequence,
 * head) never reaches the next item its thread runs.
 */

static size_t FQ_SFX(fwd_scratch_elems)(int64_t Kp, int64_t Vp)
{
    int64_t C = FQ_CHUNK;
    return (size_t)(2 * C * Kp + Kp * C + 2 * C * C + C * (Kp + Vp) + 2 * C * Vp + Kp * Vp + 3 * C);
}

/* One chunk of Lc <= C tokens starting at flat token tok0 (stride between
 * tokens: H*K for q/k, HV*V for v/o, HV for g/beta). Updates S in place.
 * next_len: tokens of the following chunk of the sequence (prefetched). */
static void FQ_SFX(fwd_chunk)(const fq_fwd_ctx *x, REAL *scr, int64_t h, int64_t j,
                              int64_t tok0, int64_t Lc, int64_t next_len, REAL *S)
{
    const fq_gdn_params *p = x->p;
    const int64_t C = FQ_CHUNK, K = p->K, V = p->V, Kp = x->Kp, Vp = x->Vp, XW = Kp + Vp;
    const int64_t H = p->H, HV = p->HV;
    const REAL scale = (REAL)p->scale;
    REAL *Qc = scr, *Kc = Qc + C * Kp, *KT = Kc + C * Kp, *G = KT + Kp * C;
    REAL *X = G + 2 * C * C, *Vs = X + C * XW, *O = Vs + C * Vp;
    REAL *gam = O + C * Vp + Kp * Vp, *bet = gam + C, *eg = bet + C;
    REAL *Ln = G, *P = G + C * C;
    double gd[FQ_CHUNK]; /* the gate scan in double (gam is its REAL copy) */
    int seg[FQ_CHUNK];   /* seg[r]: the last full reset at or before row r, -1 if none */

    /* load the chunk: q, k (optionally L2-normalised), v, g, beta; zero rows
     * (g = beta = 0) past the end of the sequence */
    for (int64_t r = 0; r < C; r++) {
        if (r < Lc) {
            int64_t t = tok0 + r;
            FQ_LOAD(Qc + r * Kp, p->q, p->dtype, (t * H + h) * K, K);
            FQ_LOAD(Kc + r * Kp, p->k, p->dtype, (t * H + h) * K, K);
            FQ_LOAD(X + r * XW + Kp, p->v, p->dtype, (t * HV + j) * p->V, V);
            if (p->use_qk_l2norm) {
                FQ_L2NORM(Qc + r * Kp, K);
                FQ_L2NORM(Kc + r * Kp, K);
            }
            gd[r] = fq_cpu_gate_g(p, t * HV + j, j); /* fused gates applied */
            bet[r] = (REAL)fq_cpu_gate_beta(p, t * HV + j);
        } else {
            memset(Qc + r * Kp, 0, (size_t)K * sizeof(REAL));
            memset(Kc + r * Kp, 0, (size_t)K * sizeof(REAL));
            memset(X + r * XW + Kp, 0, (size_t)V * sizeof(REAL));
            gd[r] = 0;
            bet[r] = 0;
        }
    }
    /* gamma_r = sum_{s <= r} g_s  (chunk-local cumulative gate), restarted
     * after each full reset g <= FQ_GATE_RESET (gdn.h): never -inf - -inf.
     * e^gamma_r = 0 once a reset lies in 0..r. */
    fq_cpu_gate_scan(gd, seg, C);
    for (int64_t r = 0; r < C; r++) {
        gam[r] = (REAL)gd[r];
        eg[r] = seg[r] < 0 ? FQ_EXP(gam[r]) : (REAL)0;
    }

    /* KT = K^T */
    for (int64_t r = 0; r < C; r++)
        for (int64_t i = 0; i < Kp; i++) KT[i * C + r] = Kc[r * Kp + i];

    /* G_kk = K K^T, G_qk = Q K^T   (only the lower-triangular tiles) */
    FQ_GEMM(C, C, Kp, Kc, Kp, KT, C, G, C, 0, 0, FQ_TRI_N);
    FQ_GEMM(C, C, Kp, Qc, Kp, KT, C, P, C, 0, 0, FQ_TRI_N);

    /* Ln = -L = -strict_lower(diag(beta) (K K^T . Gamma)),
     * P  = scale * lower_incl_diag(Q K^T . Gamma),
     * Gamma_rs = e^{gam_r - gam_s} inside one reset segment, 0 across a reset */
    for (int64_t r = 0; r < C; r++) {
        REAL *ln = Ln + r * C, *pr = P + r * C;
        const REAL gr = gam[r], nb = -bet[r];
        const int sr = seg[r];
        for (int64_t s = 0; s < C; s++) {
            REAL e = FQ_EXP(s <= r ? gr - gam[s] : (REAL)0);
            e = seg[s] == sr ? e : (REAL)0;
            REAL l = nb * ln[s] * e, q = scale * pr[s] * e;
            ln[s] = s < r ? l : (REAL)0;
            pr[s] = s <= r ? q : (REAL)0;
        }
    }

    /* X = [ -diag(beta e^gam) K | diag(beta) V ] */
    for (int64_t r = 0; r < C; r++) {
        REAL *xr = X + r * XW;
        const REAL *kr = Kc + r * Kp;
        const REAL a = -bet[r] * eg[r], b = bet[r];
        for (int64_t i = 0; i < K; i++) xr[i] = a * kr[i];
        for (int64_t i = Kp; i < Kp + V; i++) xr[i] *= b;
    }

    /* (I + L) [-W | U] = X by blocked forward substitution (A = (I+L)^-1):
     * rows r0..r0+7 first take X_r += sum_{s < r0} Ln_rs Y_s (micro-kernel),
     * then the in-block part row by row. Meanwhile the next chunk's q, k, v
     * rows are prefetched (the inputs stream from memory, rows far apart). */
    for (int64_t r0 = 0; r0 < C; r0 += 8) {
        const int64_t pf_end = next_len < r0 + 8 ? next_len : r0 + 8;
        for (int64_t r = r0; r < pf_end; r++) {
            const int64_t t = tok0 + C + r;
            fq_cpu_prefetch_row(p->q, p->dtype, (t * H + h) * K, K);
            fq_cpu_prefetch_row(p->k, p->dtype, (t * H + h) * K, K);
            fq_cpu_prefetch_row(p->v, p->dtype, (t * HV + j) * V, V);
        }
        if (r0 > 0) FQ_GEMM(8, XW, r0, Ln + r0 * C, C, X, XW, X + r0 * XW, XW, 1, 1, FQ_TRI_NONE);
        for (int64_t r = r0 + 1; r < r0 + 8; r++) {
            REAL *restrict yr = X + r * XW;
            for (int64_t s = r0; s < r; s++) {
                const REAL l = Ln[r * C + s];
                const REAL *restrict ys = X + s * XW;
                for (int64_t i = 0; i < XW; i++) yr[i] += l * ys[i];
            }
        }
    }

    /* Vn = U - W S   (into the right half of X) */
    FQ_GEMM(C, Vp, Kp, X, XW, S, Vp, X + Kp, XW, 1, 1, FQ_TRI_NONE);

    /* O = scale diag(e^gam) Q S + P Vn */
    for (int64_t r = 0; r < C; r++) {
        const REAL a = scale * eg[r];
        REAL *qr = Qc + r * Kp;
        for (int64_t i = 0; i < K; i++) qr[i] *= a;
    }
    FQ_GEMM(C, Vp, Kp, Qc, Kp, S, Vp, O, Vp, 0, 0, FQ_TRI_NONE);
    /* exactly lower-triangular: o_r never meets Vn rows s > r (a NaN at a
     * later token must not reach an earlier output) */
    FQ_TRMM_LOWER(C, Vp, P, C, X + Kp, XW, O, Vp, 1, 1);
    for (int64_t r = 0; r < Lc; r++) FQ_STORE(p->o, p->dtype, ((tok0 + r) * HV + j) * V, O + r * Vp, V);

    /* S' = e^{gam_C} S + K^T diag(e^{gam_C - gam}) Vn  (e^{gam_C - gam_r} = 0
     * when a reset lies in r+1..C; e^{gam_C} = eg[C-1] is 0 after any reset) */
    const double gC = gd[C - 1];
    for (int64_t r = 0; r < C; r++) {
        const REAL *vn = X + r * XW + Kp;
        REAL *vs = Vs + r * Vp;
        const REAL d = seg[r] == seg[C - 1] ? FQ_EXP((REAL)(gC - gd[r])) : (REAL)0;
        for (int64_t i = 0; i < Vp; i++) vs[i] = d * vn[i];
    }
    FQ_GEMM(Kp, Vp, C, KT, C, Vs, Vp, S, Vp, eg[C - 1], 1, FQ_TRI_NONE);
}

static void FQ_SFX(fwd_item)(void *vctx, int64_t item, int thread_id)
{
    const fq_fwd_ctx *x = (const fq_fwd_ctx *)vctx;
    const fq_gdn_params *p = x->p;
    const int64_t C = FQ_CHUNK, K = p->K, V = p->V, Kp = x->Kp, Vp = x->Vp;
    const int64_t n = item / p->HV, j = item % p->HV, h = j / (p->HV / p->H);
    REAL *scr = (REAL *)x->scratch[thread_id];
    if (Kp != K || Vp != V) memset(scr, 0, FQ_SFX(fwd_scratch_elems)(Kp, Vp) * sizeof(REAL));
    REAL *S = scr + 2 * C * Kp + Kp * C + 2 * C * C + C * (Kp + Vp) + 2 * C * Vp;
    int64_t row, first, len;
    fq_cpu_seq_bounds(p, n, &row, &first, &len);

    /* S = h0[n, j], or pool slot state_indices[n] (pool-indexed prefill),
     * or zeros (no h0, negative slot); zero-padded to Kp x Vp. The final
     * state goes back where S came from (ht, or the slot). */
    int64_t slot = n;
    const void *src = p->h0;
    void *dst = p->ht;
    if (p->state) {
        slot = p->state_indices ? fq_cpu_index(p->state_indices, p->state_indices_is_int64, n) : n;
        src = dst = slot >= 0 ? p->state : NULL;
    }
    const int64_t KV = K * V, st = (slot * p->HV + j) * KV;
    memset(S, 0, (size_t)(Kp * Vp) * sizeof(REAL));
    if (src) fq_cpu_load_state(S, Vp, src, p->state_dtype, st, K, V, p->state_vk);

    /* checkpoints: the state after every checkpoint_every tokens (a chunk
     * end, checkpoint_every being a multiple of C) to row cu_checkpoints[n] + c - 1 */
    const int64_t ne = p->checkpoint_every;
    const int64_t ck0 = ne ? ((const int64_t *)p->cu_checkpoints)[n] : 0;
    for (int64_t c0 = 0; c0 < len; c0 += C) {
        int64_t Lc = len - c0 < C ? len - c0 : C;
        int64_t next = len - c0 - Lc < C ? len - c0 - Lc : C;
        FQ_SFX(fwd_chunk)(x, scr, h, j, row * p->T + first + c0, Lc, next, S);
        if (ne && (c0 + Lc) % ne == 0)
            fq_cpu_store_state(p->checkpoints, p->state_dtype,
                                       ((ck0 + (c0 + Lc) / ne - 1) * p->HV + j) * KV, S, Vp, K, V,
                                       p->state_vk);
    }

    if (dst) fq_cpu_store_state(dst, p->state_dtype, st, S, Vp, K, V, p->state_vk);
}
