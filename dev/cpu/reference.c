/*
 * reference.c — the float64 reference of dev/cpu's checkers (reference.h):
 * DESIGN §1 token by token, and its reverse mode. Slow on purpose.
 *
 * Per sequence and value head j (q/k head h = j / (HV/H)), tokens t = 1..T:
 *
 *     a_t = exp(g_t)
 *     u_t = beta_t (v_t - a_t S_{t-1}^T k_t)
 *     S_t = a_t S_{t-1} + k_t u_t^T
 *     o_t = scale S_t^T q_t
 *
 * With use_qk_l2norm, q and k are first x / sqrt(sum x^2 + 1e-6) per head.
 */
#include "reference.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FQ_REF_L2NORM_EPS 1e-6

static void *ref_alloc(size_t n)
{
    void *a = calloc(n > 0 ? n : 1, sizeof(double));
    if (!a) {
        fprintf(stderr, "reference: out of memory\n");
        exit(2);
    }
    return a;
}

/* sequence n -> (batch row, first token, length) */
static void ref_seq(const fq_gdn_params *p, int64_t n, int64_t *row, int64_t *first, int64_t *len)
{
    if (!p->cu_seqlens) {
        *row = n;
        *first = 0;
        *len = p->T;
        return;
    }
    int64_t a = p->cu_seqlens_is_int64 ? ((const int64_t *)p->cu_seqlens)[n]
                                       : ((const int32_t *)p->cu_seqlens)[n];
    int64_t b = p->cu_seqlens_is_int64 ? ((const int64_t *)p->cu_seqlens)[n + 1]
                                       : ((const int32_t *)p->cu_seqlens)[n + 1];
    *row = 0;
    *first = a;
    *len = b - a;
}

/* x / sqrt(sum x^2 + eps) of one K-row into y; returns r = 1/sqrt(...) */
static double ref_l2norm_row(const double *x, int64_t K, int on, double *y)
{
    double ss = 0;
    for (int64_t i = 0; i < K; i++) ss += x[i] * x[i];
    double r = on ? 1.0 / sqrt(ss + FQ_REF_L2NORM_EPS) : 1.0;
    for (int64_t i = 0; i < K; i++) y[i] = x[i] * r;
    return r;
}

void fq_ref_forward(const fq_gdn_params *p, const double *q, const double *k, const double *v,
                    const double *g, const double *beta, const double *init, const int64_t *slots,
                    double *o, double *fin)
{
    const int64_t K = p->K, V = p->V, H = p->H, HV = p->HV;
    double *S = ref_alloc((size_t)(K * V)), *qn = ref_alloc((size_t)K), *kn = ref_alloc((size_t)K);
    double *u = ref_alloc((size_t)V);
    for (int64_t n = 0; n < p->N; n++) {
        int64_t row, first, len;
        ref_seq(p, n, &row, &first, &len);
        int64_t slot = slots ? slots[n] : n;
        for (int64_t j = 0; j < HV; j++) {
            int64_t h = j / (HV / H);
            if (slot < 0) {
                for (int64_t t = 0; t < len; t++)
                    memset(o + ((row * p->T + first + t) * HV + j) * V, 0, (size_t)V * sizeof *o);
                continue;
            }
            if (init) memcpy(S, init + (slot * HV + j) * K * V, (size_t)(K * V) * sizeof *S);
            else memset(S, 0, (size_t)(K * V) * sizeof *S);
            for (int64_t t = 0; t < len; t++) {
                int64_t tok = row * p->T + first + t;
                ref_l2norm_row(q + (tok * H + h) * K, K, p->use_qk_l2norm, qn);
                ref_l2norm_row(k + (tok * H + h) * K, K, p->use_qk_l2norm, kn);
                double a = exp(g[tok * HV + j]), b = beta[tok * HV + j];
                for (int64_t c = 0; c < V; c++) {
                    double s = 0;
                    for (int64_t i = 0; i < K; i++) s += S[i * V + c] * kn[i];
                    /* u_t = beta (v_t - a S^T k_t) */
                    u[c] = b * (v[(tok * HV + j) * V + c] - a * s);
                }
                /* S_t = a S_{t-1} + k_t u_t^T */
                for (int64_t i = 0; i < K; i++)
                    for (int64_t c = 0; c < V; c++) S[i * V + c] = a * S[i * V + c] + kn[i] * u[c];
                /* o_t = scale S_t^T q_t */
                for (int64_t c = 0; c < V; c++) {
                    double s = 0;
                    for (int64_t i = 0; i < K; i++) s += S[i * V + c] * qn[i];
                    o[(tok * HV + j) * V + c] = p->scale * s;
                }
            }
            if (fin) memcpy(fin + (slot * HV + j) * K * V, S, (size_t)(K * V) * sizeof *S);
        }
    }
    free(S);
    free(qn);
    free(kn);
    free(u);
}

/* One sequence, one value head; q, k rows already normalised. dq, dk are
 * added to (gradients of the normalised rows); dv, dg, db, dh0 written.
 * S has (T+1)*K*V entries, u T*V, dS K*V. */
static void ref_head_backward(int64_t T, int64_t K, int64_t V, double scale, const double *q,
                              const double *k, const double *v, const double *g, const double *b,
                              const double *h0, const double *dO, const double *dht, double *dq,
                              double *dk, double *dv, double *dg, double *db, double *dh0,
                              double *S, double *u, double *dS)
{
    const int64_t KV = K * V;
    double *pred = ref_alloc((size_t)V), *du = ref_alloc((size_t)V);
    for (int64_t i = 0; i < KV; i++) S[i] = h0 ? h0[i] : 0.0;
    for (int64_t t = 0; t < T; t++) { /* S_t = a S_{t-1} + k u^T, u = b (v - a S^T k) */
        const double a = exp(g[t]), *Sp = S + t * KV;
        double *Sn = S + (t + 1) * KV;
        for (int64_t c = 0; c < V; c++) {
            double s = 0;
            for (int64_t i = 0; i < K; i++) s += Sp[i * V + c] * k[t * K + i];
            u[t * V + c] = b[t] * (v[t * V + c] - a * s);
        }
        for (int64_t i = 0; i < K; i++)
            for (int64_t c = 0; c < V; c++)
                Sn[i * V + c] = a * Sp[i * V + c] + k[t * K + i] * u[t * V + c];
    }
    for (int64_t i = 0; i < KV; i++) dS[i] = dht ? dht[i] : 0.0;
    for (int64_t t = T - 1; t >= 0; t--) {
        const double a = exp(g[t]), *Sp = S + t * KV, *Sn = S + (t + 1) * KV;
        const double *qt = q + t * K, *kt = k + t * K, *dot = dO + t * V, *ut = u + t * V;
        /* forward: o_t = scale S_t^T q_t */
        for (int64_t i = 0; i < K; i++) {
            double s = 0;
            for (int64_t c = 0; c < V; c++) {
                s += Sn[i * V + c] * dot[c];
                dS[i * V + c] += scale * qt[i] * dot[c];
            }
            dq[t * K + i] += scale * s;
        }
        /* forward: S_t = a S_{t-1} + k u^T */
        for (int64_t c = 0; c < V; c++) {
            double s = 0, pr = 0;
            for (int64_t i = 0; i < K; i++) {
                s += kt[i] * dS[i * V + c];
                pr += Sp[i * V + c] * kt[i];
            }
            du[c] = s;
            pred[c] = pr;
        }
        double da = 0;
        for (int64_t i = 0; i < K; i++) {
            double s = 0;
            for (int64_t c = 0; c < V; c++) {
                s += dS[i * V + c] * ut[c];
                da += Sp[i * V + c] * dS[i * V + c];
            }
            dk[t * K + i] += s;
        }
        /* forward: u = b (v - a pred), pred = S_{t-1}^T k */
        double dbt = 0, dup = 0;
        for (int64_t c = 0; c < V; c++) {
            dbt += du[c] * (v[t * V + c] - a * pred[c]);
            dv[t * V + c] = b[t] * du[c];
            dup += du[c] * pred[c];
        }
        db[t] = dbt;
        da -= b[t] * dup;
        for (int64_t i = 0; i < K; i++) {
            double s = 0;
            for (int64_t c = 0; c < V; c++) {
                const double dpred = -b[t] * a * du[c];
                s += Sp[i * V + c] * dpred;
                dS[i * V + c] = a * dS[i * V + c] + kt[i] * dpred;
            }
            dk[t * K + i] += s;
        }
        /* forward: a = exp(g) */
        dg[t] = a * da;
    }
    if (dh0) memcpy(dh0, dS, (size_t)KV * sizeof *dS);
    free(pred);
    free(du);
}

void fq_ref_backward(const fq_gdn_params *p, const double *q, const double *k, const double *v,
                     const double *g, const double *beta, const double *h0, const double *dout,
                     const double *dht, double *dq, double *dk, double *dv, double *dg,
                     double *dbeta, double *dh0)
{
    const int64_t H = p->H, HV = p->HV, K = p->K, V = p->V, G = HV / H, T = p->T;
    int64_t Tmax = 0;
    for (int64_t n = 0; n < p->N; n++) {
        int64_t row, first, len;
        ref_seq(p, n, &row, &first, &len);
        if (len > Tmax) Tmax = len;
    }
    double *S = ref_alloc((size_t)((Tmax + 1) * K * V)), *u = ref_alloc((size_t)(Tmax * V));
    double *dS = ref_alloc((size_t)(K * V));
    double *hq = ref_alloc((size_t)(Tmax * K)), *hk = ref_alloc((size_t)(Tmax * K));
    double *rq = ref_alloc((size_t)Tmax), *rk = ref_alloc((size_t)Tmax);
    double *hv = ref_alloc((size_t)(Tmax * V)), *hdo = ref_alloc((size_t)(Tmax * V));
    double *hg = ref_alloc((size_t)Tmax), *hb = ref_alloc((size_t)Tmax);
    double *hdq = ref_alloc((size_t)(Tmax * K)), *hdk = ref_alloc((size_t)(Tmax * K));
    double *hdv = ref_alloc((size_t)(Tmax * V)), *hdg = ref_alloc((size_t)Tmax);
    double *hdb = ref_alloc((size_t)Tmax), *hdh0 = ref_alloc((size_t)(K * V));
    for (int64_t n = 0; n < p->N; n++) {
        int64_t row, first, len;
        ref_seq(p, n, &row, &first, &len);
        const int64_t t0 = row * T + first;
        for (int64_t h = 0; h < H; h++) {
            for (int64_t t = 0; t < len; t++) {
                rq[t] = ref_l2norm_row(q + ((t0 + t) * H + h) * K, K, p->use_qk_l2norm, hq + t * K);
                rk[t] = ref_l2norm_row(k + ((t0 + t) * H + h) * K, K, p->use_qk_l2norm, hk + t * K);
            }
            memset(hdq, 0, (size_t)(Tmax * K) * sizeof *hdq);
            memset(hdk, 0, (size_t)(Tmax * K) * sizeof *hdk);
            for (int64_t j = h * G; j < (h + 1) * G; j++) {
                for (int64_t t = 0; t < len; t++) {
                    memcpy(hv + t * V, v + ((t0 + t) * HV + j) * V, (size_t)V * sizeof *hv);
                    memcpy(hdo + t * V, dout + ((t0 + t) * HV + j) * V, (size_t)V * sizeof *hdo);
                    hg[t] = g[(t0 + t) * HV + j];
                    hb[t] = beta[(t0 + t) * HV + j];
                }
                ref_head_backward(len, K, V, p->scale, hq, hk, hv, hg, hb,
                                  h0 ? h0 + (n * HV + j) * K * V : NULL, hdo,
                                  dht ? dht + (n * HV + j) * K * V : NULL, hdq, hdk, hdv, hdg, hdb,
                                  hdh0, S, u, dS);
                if (dh0) memcpy(dh0 + (n * HV + j) * K * V, hdh0, (size_t)(K * V) * sizeof *hdh0);
                for (int64_t t = 0; t < len; t++) {
                    memcpy(dv + ((t0 + t) * HV + j) * V, hdv + t * V, (size_t)V * sizeof *hdv);
                    dg[(t0 + t) * HV + j] = hdg[t];
                    dbeta[(t0 + t) * HV + j] = hdb[t];
                }
            }
            /* forward: x_hat = x r, r = (sum x^2 + eps)^(-1/2)
             *   =>  dx = r dx_hat - r^3 (x . dx_hat) x  =  r (dx_hat - x_hat (x_hat . dx_hat)) */
            for (int64_t t = 0; t < len; t++) {
                for (int w = 0; w < 2; w++) {
                    const double *xh = (w ? hk : hq) + t * K, *d = (w ? hdk : hdq) + t * K;
                    const double r = w ? rk[t] : rq[t];
                    double *out = (w ? dk : dq) + ((t0 + t) * H + h) * K;
                    double xd = 0;
                    if (p->use_qk_l2norm)
                        for (int64_t i = 0; i < K; i++) xd += xh[i] * d[i];
                    for (int64_t i = 0; i < K; i++) out[i] = r * (d[i] - xh[i] * xd);
                }
            }
        }
    }
    free(S); free(u); free(dS); free(hq); free(hk); free(rq); free(rk); free(hv); free(hdo);
    free(hg); free(hb); free(hdq); free(hdk); free(hdv); free(hdg); free(hdb); free(hdh0);
}

double fq_ref_rel_error(const double *out, const double *ref, int64_t n)
{
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(out[i])) return INFINITY;
        num += (out[i] - ref[i]) * (out[i] - ref[i]);
        den += ref[i] * ref[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}
