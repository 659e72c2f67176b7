/*
 * gdn_cpu_recurrent_impl.h — the CPU recurrent step for one real type.
 * Included twice by gdn_cpu_recurrent.c (REAL = float, then double) with the
 * macros REAL, FQ_SFX, FQ_LOAD, FQ_STORE, FQ_EXP, FQ_L2NORM (see
 * gdn_cpu_fwd_impl.h) and fq_rec_ctx, FQ_NB, FQ_TG defined; optionally
 * FQ_REC_VEC_BLOCKS(S, K, V, nt, q, k, v, o, alpha, beta, kq, scale), an
 * instruction set's block kernel (gdn_cpu_kernels.h) that runs the group on
 * the leading columns of S and returns how many it took; the portable block
 * kernel below does the rest.
 *
 * Per token (DESIGN §1), S in R^{K x V} row-major:
 *
 *     sk = S^T k,  sq = S^T q                  (a pass over S)
 *     u  = beta (v - alpha sk)
 *     o  = scale S_new^T q = scale (alpha sq + u (k . q))
 *     S  = alpha S + k u^T                     (a second pass, fused with the
 *                                               first pass of token t+1)
 *
 * Column c of S evolves on its own (u[c] needs only S[:, c]), so a group of
 * up to FQ_TG tokens runs to completion on one block of FQ_NB columns
 * (K x FQ_NB values, L1-resident) before the next block: the state is read
 * from memory once per call and written back once.
 */

/* Token group data: q, k (normalised if asked), v rows, alpha = e^g, beta,
 * kq = k . q, and the o rows being produced. */
typedef struct {
    REAL *q, *k, *v, *o; /* [FQ_TG, K], [FQ_TG, K], [FQ_TG, V], [FQ_TG, V] */
    REAL *alpha, *beta, *kq;
} FQ_SFX(rec_group);

/* Portable block kernel: tokens 0..nt-1 of the group on columns c0..c0+nb-1. */
static void FQ_SFX(rec_block_generic)(REAL *restrict S, int64_t K, int64_t V, int64_t c0,
                                      int64_t nb, int64_t nt, const FQ_SFX(rec_group) *G,
                                      REAL scale)
{
    REAL sk[FQ_NB], sq[FQ_NB], u[FQ_NB];
    /* sk = S^T k_0, sq = S^T q_0 */
    for (int64_t c = 0; c < nb; c++) sk[c] = sq[c] = 0;
    for (int64_t i = 0; i < K; i++) {
        const REAL *restrict s = S + i * V + c0;
        const REAL ki = G->k[i], qi = G->q[i];
        for (int64_t c = 0; c < nb; c++) {
            sk[c] += ki * s[c];
            sq[c] += qi * s[c];
        }
    }
    for (int64_t t = 0; t < nt; t++) {
        const REAL a = G->alpha[t], b = G->beta[t], kq = G->kq[t];
        const REAL *v = G->v + t * V + c0;
        REAL *o = G->o + t * V + c0;
        /* u = beta (v - alpha S^T k);  o = scale (alpha S^T q + u (k . q)) */
        for (int64_t c = 0; c < nb; c++) {
            u[c] = b * (v[c] - a * sk[c]);
            o[c] = scale * (a * sq[c] + u[c] * kq);
        }
        /* S = alpha S + k u^T, and S^T k', S^T q' for token t+1 */
        const REAL *k = G->k + t * K;
        if (t + 1 < nt) {
            const REAL *kn = G->k + (t + 1) * K, *qn = G->q + (t + 1) * K;
            for (int64_t c = 0; c < nb; c++) sk[c] = sq[c] = 0;
            for (int64_t i = 0; i < K; i++) {
                REAL *restrict s = S + i * V + c0;
                for (int64_t c = 0; c < nb; c++) {
                    REAL x = a * s[c] + k[i] * u[c];
                    s[c] = x;
                    sk[c] += kn[i] * x;
                    sq[c] += qn[i] * x;
                }
            }
        } else {
            for (int64_t i = 0; i < K; i++) {
                REAL *restrict s = S + i * V + c0;
                for (int64_t c = 0; c < nb; c++) s[c] = a * s[c] + k[i] * u[c];
            }
        }
    }
}

/* scratch per thread (REAL): a state copy [K*V] (used only when the pool's
 * dtype is not REAL) and the token group. */
static size_t FQ_SFX(rec_scratch_elems)(int64_t K, int64_t V)
{
    return (size_t)(K * V + FQ_TG * (2 * K + 2 * V + 3));
}

static void FQ_SFX(rec_item)(void *vctx, int64_t item, int thread_id)
{
    const fq_rec_ctx *x = (const fq_rec_ctx *)vctx;
    const fq_gdn_params *p = x->p;
    const int64_t K = p->K, V = p->V, H = p->H, HV = p->HV;
    const int64_t n = item / HV, j = item % HV, h = j / (HV / H);
    const REAL scale = (REAL)p->scale;
    int64_t row, first, len;
    fq_cpu_seq_bounds(p, n, &row, &first, &len);
    const int64_t tok0 = row * p->T + first;

    REAL *Sbuf = (REAL *)x->scratch[thread_id];
    FQ_SFX(rec_group) G;
    G.q = Sbuf + K * V;
    G.k = G.q + FQ_TG * K;
    G.v = G.k + FQ_TG * K;
    G.o = G.v + FQ_TG * V;
    G.alpha = G.o + FQ_TG * V;
    G.beta = G.alpha + FQ_TG;
    G.kq = G.beta + FQ_TG;

    int64_t slot = p->state_indices ? fq_cpu_index(p->state_indices, p->state_indices_is_int64, n) : n;
    if (slot < 0) { /* padding: o rows are zero, the pool is untouched */
        memset(G.o, 0, (size_t)V * sizeof(REAL));
        for (int64_t t = 0; t < len; t++) FQ_STORE(p->o, p->dtype, ((tok0 + t) * HV + j) * V, G.o, V);
        return;
    }
    if (len == 0) return;

    /* S: the pool entry itself when its dtype is REAL, its layout [K][V] and
     * the pool is to be updated; else a copy ([K][V], row stride V) */
    const int64_t st = (slot * HV + j) * K * V;
    const int in_place = p->state_dtype == (sizeof(REAL) == 8 ? FQ_F64 : FQ_F32) && !p->state_vk &&
                         !p->no_state_update;
    REAL *S = in_place ? (REAL *)p->state + st : Sbuf;
    if (!in_place) fq_cpu_load_state(S, V, p->state, p->state_dtype, st, K, V, p->state_vk);

    /* with intermediate_states the state after every token is stored, so
     * groups of one token (the block kernels then re-read S from L1/L2) */
    const int64_t tg = p->intermediate_states ? 1 : FQ_TG;
    for (int64_t g0 = 0; g0 < len; g0 += tg) {
        const int64_t nt = len - g0 < tg ? len - g0 : tg;
        for (int64_t t = 0; t < nt; t++) { /* load the group's tokens */
            const int64_t tok = tok0 + g0 + t;
            REAL *q = G.q + t * K, *k = G.k + t * K;
            FQ_LOAD(q, p->q, p->dtype, (tok * H + h) * K, K);
            FQ_LOAD(k, p->k, p->dtype, (tok * H + h) * K, K);
            FQ_LOAD(G.v + t * V, p->v, p->dtype, (tok * HV + j) * V, V);
            if (p->use_qk_l2norm) {
                FQ_L2NORM(q, K);
                FQ_L2NORM(k, K);
            }
            REAL kq = 0;
            for (int64_t i = 0; i < K; i++) kq += k[i] * q[i];
            G.kq[t] = kq;
            G.alpha[t] = FQ_EXP((REAL)fq_cpu_gate_g(p, tok * HV + j, j)); /* fused gates applied */
            G.beta[t] = (REAL)fq_cpu_gate_beta(p, tok * HV + j);
        }
        int64_t c0 = 0;
#ifdef FQ_REC_VEC_BLOCKS
        /* the instruction set's vector blocks take columns 0 .. c0-1 */
        c0 = FQ_REC_VEC_BLOCKS(S, K, V, nt, G.q, G.k, G.v, G.o, G.alpha, G.beta, G.kq, scale);
#endif
        for (; c0 < V; c0 += FQ_NB) {
            const int64_t nb = V - c0 < FQ_NB ? V - c0 : FQ_NB;
            FQ_SFX(rec_block_generic)(S, K, V, c0, nb, nt, &G, scale);
        }
        for (int64_t t = 0; t < nt; t++)
            FQ_STORE(p->o, p->dtype, ((tok0 + g0 + t) * HV + j) * V, G.o + t * V, V);
        if (p->intermediate_states) /* the state after token g0 */
            fq_cpu_store_state(p->intermediate_states, p->state_dtype,
                                       ((n * p->Ti + g0) * HV + j) * K * V, S, V, K, V, p->state_vk);
    }
    if (!in_place && !p->no_state_update)
        fq_cpu_store_state(p->state, p->state_dtype, st, S, V, K, V, p->state_vk);
}
