/*
 * check_cpu.c — standalone check of the CPU chunked forward and recurrent step
 * against a float64 token-by-token reference of DESIGN §1 (no Python).
 *
 *   make -C dev check_cpu        builds dev/build/check_cpu and runs it (all cases)
 *   dev/build/check_cpu small    valgrind-sized cases
 *
 * valgrind has no AVX-512: build with `make -C dev CPU_ARCH=-march=x86-64-v3`
 * (portable kernels) and run
 *   valgrind --leak-check=full --error-exitcode=3 dev/build/check_cpu small
 * (AVX-512 paths: `make -C dev SANITIZE=1`, -fsanitize=address,undefined).
 *
 * The reference is dev/cpu/reference.c (float64, token by token), the
 * tolerances the project's table (flashqla/reference.py, as
 * dev/build/tolerance.h). Outputs are NaN-poisoned before each call;
 * rel = ||out - ref||_2 / ||ref||_2; NaN/Inf never passes. Exit status 1 if
 * any case fails.
 */
#include "cpu/gdn_cpu.h"
#include "reference.h"
#include "tolerance.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ random ---- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static double urand(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return ((z >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

static double randn(void)
{
    return sqrt(-2.0 * log(urand())) * cos(6.283185307179586 * urand());
}

static void set1(void *base, fq_dtype dt, int64_t i, double x)
{
    switch (dt) {
    case FQ_F32: ((float *)base)[i] = (float)x; break;
    case FQ_F16: ((uint16_t *)base)[i] = fq_cpu_f32_to_f16((float)x); break;
    case FQ_BF16: ((uint16_t *)base)[i] = fq_cpu_f32_to_bf16((float)x); break;
    case FQ_F64: ((double *)base)[i] = x; break;
    }
}

static void *alloc_arr(fq_dtype dt, int64_t n)
{
    void *a = malloc((size_t)(n > 0 ? n : 1) * fq_dtype_size(dt));
    if (!a) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return a;
}

static void poison(void *base, fq_dtype dt, int64_t n)
{
    for (int64_t i = 0; i < n; i++) set1(base, dt, i, NAN);
}

/* rows of length d, each randn; if unit, L2-normalised (in double) */
static void fill_rows(void *base, fq_dtype dt, int64_t rows, int64_t d, int unit, double mul)
{
    double *tmp = malloc((size_t)d * sizeof *tmp);
    for (int64_t r = 0; r < rows; r++) {
        double ss = 0;
        for (int64_t i = 0; i < d; i++) {
            tmp[i] = randn();
            ss += tmp[i] * tmp[i];
        }
        for (int64_t i = 0; i < d; i++) set1(base, dt, r * d + i, (unit ? tmp[i] / sqrt(ss) : tmp[i]) * mul);
    }
    free(tmp);
}

static double softplus(double x) { return x > 20 ? x : log1p(exp(x)); }

/* ------------------------------------------------ float64 reference ---- */

static double *to_f64(const void *base, fq_dtype dt, int64_t n)
{
    double *x = malloc((size_t)(n > 0 ? n : 1) * sizeof *x);
    if (!x) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    fq_cpu_load_f64(x, base, dt, 0, n);
    return x;
}

/* The reference (dev/cpu/reference.c) on the inputs in p, read as doubles.
 * init: [*, HV, K, V] or NULL (zeros); slot of sequence n in init/fin:
 * slots[n] (or n if slots == NULL); slot < 0 -> o rows 0, nothing else. */
static void reference(const fq_gdn_params *p, const int64_t *slots, const double *init,
                      double *o, double *fin)
{
    const int64_t BT = p->B * p->T;
    double *q = to_f64(p->q, p->dtype, BT * p->H * p->K), *k = to_f64(p->k, p->dtype, BT * p->H * p->K);
    double *v = to_f64(p->v, p->dtype, BT * p->HV * p->V);
    double *g = to_f64(p->g, p->gate_dtype, BT * p->HV), *b = to_f64(p->beta, p->gate_dtype, BT * p->HV);
    fq_ref_forward(p, q, k, v, g, b, init, slots, o, fin);
    free(q);
    free(k);
    free(v);
    free(g);
    free(b);
}

/* rel = ||out - ref|| / ||ref||; +Inf if out has NaN/Inf */
static double rel_err(const void *out, fq_dtype dt, const double *ref, int64_t n)
{
    double *x = to_f64(out, dt, n);
    double e = fq_ref_rel_error(x, ref, n);
    free(x);
    return e;
}

/* ------------------------------------------------------------ cases ---- */

typedef struct {
    const char *name;
    fq_dtype dtype, gate_dtype;
    int64_t B, T, H, HV, K, V;
    int nseq;               /* > 0: cu_seqlens from lens[] (B = 1) */
    int64_t lens[8];
    int with_h0, with_ht, l2norm;
    double A_max;           /* per-head decay A_h from 0 .. A_max */
    int cu64;
} fq_case;

typedef struct {
    fq_gdn_params p;
    void *q, *k, *v, *g, *beta, *h0, *o, *ht;
    int64_t *cu;
    double *h0d;
} fq_inputs;

static void make_inputs(const fq_case *c, fq_inputs *in)
{
    fq_gdn_params *p = &in->p;
    fq_params_init(p);
    memset(in, 0, sizeof *in);
    fq_params_init(p);
    p->B = c->B;
    p->H = c->H;
    p->HV = c->HV;
    p->K = c->K;
    p->V = c->V;
    p->dtype = c->dtype;
    p->gate_dtype = c->gate_dtype;
    p->state_dtype = c->dtype == FQ_F64 ? FQ_F64 : FQ_F32;
    p->use_qk_l2norm = c->l2norm;
    p->scale = 1.0 / sqrt((double)c->K);
    if (c->nseq > 0) {
        int64_t T = 0;
        in->cu = malloc((size_t)(c->nseq + 1) * sizeof(int64_t));
        in->cu[0] = 0;
        for (int i = 0; i < c->nseq; i++) in->cu[i + 1] = (T += c->lens[i]);
        p->T = T;
        p->N = c->nseq;
        if (c->cu64) {
            p->cu_seqlens = in->cu;
            p->cu_seqlens_is_int64 = 1;
        } else {
            int32_t *c32 = malloc((size_t)(c->nseq + 1) * sizeof(int32_t));
            for (int i = 0; i <= c->nseq; i++) c32[i] = (int32_t)in->cu[i];
            free(in->cu);
            in->cu = (int64_t *)c32;
            p->cu_seqlens = c32;
        }
    } else {
        p->T = c->T;
        p->N = c->B;
    }
    const int64_t BT = p->B * p->T;
    in->q = alloc_arr(p->dtype, BT * p->H * p->K);
    in->k = alloc_arr(p->dtype, BT * p->H * p->K);
    in->v = alloc_arr(p->dtype, BT * p->HV * p->V);
    in->o = alloc_arr(p->dtype, BT * p->HV * p->V);
    in->g = alloc_arr(p->gate_dtype, BT * p->HV);
    in->beta = alloc_arr(p->gate_dtype, BT * p->HV);
    /* with l2norm on, q/k are raw randn (the operator normalises) */
    fill_rows(in->q, p->dtype, BT * p->H, p->K, !c->l2norm, c->l2norm ? 0.7 : 1.0);
    fill_rows(in->k, p->dtype, BT * p->H, p->K, !c->l2norm, c->l2norm ? 1.3 : 1.0);
    fill_rows(in->v, p->dtype, BT * p->HV, p->V, 0, 1.0);
    for (int64_t t = 0; t < BT; t++)
        for (int64_t j = 0; j < p->HV; j++) {
            double A = p->HV > 1 ? c->A_max * (double)j / (double)(p->HV - 1) : c->A_max;
            set1(in->g, p->gate_dtype, t * p->HV + j, -A * softplus(0.5 * randn() + 1.0));
            set1(in->beta, p->gate_dtype, t * p->HV + j, 1.0 / (1.0 + exp(-randn())));
        }
    const int64_t SN = p->N * p->HV * p->K * p->V;
    in->h0d = malloc((size_t)(SN > 0 ? SN : 1) * sizeof(double));
    if (c->with_h0) {
        in->h0 = alloc_arr(p->state_dtype, SN);
        fill_rows(in->h0, p->state_dtype, SN / p->V, p->V, 0, 0.3);
        for (int64_t i = 0; i < SN; i++) in->h0d[i] = fq_cpu_load1(in->h0, p->state_dtype, i);
        p->h0 = in->h0;
    }
    if (c->with_ht) {
        in->ht = alloc_arr(p->state_dtype, SN);
        p->ht = in->ht;
    }
    p->q = in->q;
    p->k = in->k;
    p->v = in->v;
    p->g = in->g;
    p->beta = in->beta;
    p->o = in->o;
}

static void free_inputs(fq_inputs *in)
{
    free(in->q); free(in->k); free(in->v); free(in->g); free(in->beta);
    free(in->h0); free(in->o); free(in->ht); free(in->cu); free(in->h0d);
}

static int failures = 0;

static void report(const char *what, const char *name, double e_o, double e_s, double tol)
{
    int ok = e_o <= tol && e_s <= tol;
    if (!ok) failures++;
    printf("%-9s %-44s o %.2e  state %.2e  (tol %.0e)  %s\n", what, name, e_o, e_s, tol,
           ok ? "ok" : "FAIL");
}

/* chunked forward vs the reference */
static void check_fwd(const fq_case *c, int nthreads)
{
    fq_inputs in;
    make_inputs(c, &in);
    fq_gdn_params *p = &in.p;
    p->num_threads = nthreads;
    const int64_t On = p->B * p->T * p->HV * p->V, SN = p->N * p->HV * p->K * p->V;
    poison(in.o, p->dtype, On);
    if (in.ht) poison(in.ht, p->state_dtype, SN);
    fq_status st = fq_cpu_chunk_fwd(p);
    if (st != FQ_OK) {
        printf("fwd %s: status %d: %s  FAIL\n", c->name, st, fq_last_error());
        failures++;
        free_inputs(&in);
        return;
    }
    double *o_ref = malloc((size_t)(On > 0 ? On : 1) * sizeof(double));
    double *s_ref = malloc((size_t)(SN > 0 ? SN : 1) * sizeof(double));
    reference(p, NULL, c->with_h0 ? in.h0d : NULL, o_ref, s_ref);
    double e_o = rel_err(in.o, p->dtype, o_ref, On);
    double e_s = in.ht ? rel_err(in.ht, p->state_dtype, s_ref, SN) : 0;
    report("fwd", c->name, e_o, e_s, fq_tolerance(c->dtype, FQ_TOL_OUT));
    free(o_ref);
    free(s_ref);
    free_inputs(&in);
}

/* recurrent step on a pool with P = N + 2 slots, indices reversed, sequence 1
 * (if N > 1) padding (-1); and chunked fwd == recurrent on the same tokens */
static void check_recurrent(const fq_case *c, int nthreads, int indices64)
{
    fq_inputs in;
    make_inputs(c, &in);
    fq_gdn_params *p = &in.p;
    p->num_threads = nthreads;
    const int64_t N = p->N, P = N + 2, per = p->HV * p->K * p->V;
    const int64_t On = p->B * p->T * p->HV * p->V;
    int64_t *slots = malloc((size_t)N * sizeof *slots);
    int32_t *slots32 = malloc((size_t)N * sizeof *slots32);
    for (int64_t n = 0; n < N; n++) slots[n] = (N > 1 && n == 1) ? -1 : P - 1 - n;
    for (int64_t n = 0; n < N; n++) slots32[n] = (int32_t)slots[n];
    void *pool = alloc_arr(p->state_dtype, P * per);
    fill_rows(pool, p->state_dtype, P * per / p->V, p->V, 0, 0.3);
    double *pool_ref = malloc((size_t)(P * per) * sizeof(double));
    for (int64_t i = 0; i < P * per; i++) pool_ref[i] = fq_cpu_load1(pool, p->state_dtype, i);
    double *pool_init = malloc((size_t)(P * per) * sizeof(double));
    memcpy(pool_init, pool_ref, (size_t)(P * per) * sizeof(double));

    p->h0 = NULL;
    p->ht = NULL;
    p->state = pool;
    p->P = P;
    p->state_indices = indices64 ? (const void *)slots : (const void *)slots32;
    p->state_indices_is_int64 = indices64;
    poison(in.o, p->dtype, On);
    fq_status st = fq_cpu_recurrent(p);
    if (st != FQ_OK) {
        printf("recurrent %s: status %d: %s  FAIL\n", c->name, st, fq_last_error());
        failures++;
    } else {
        double *o_ref = malloc((size_t)(On > 0 ? On : 1) * sizeof(double));
        reference(p, slots, pool_init, o_ref, pool_ref);
        report("recurrent", c->name, rel_err(in.o, p->dtype, o_ref, On),
               rel_err(pool, p->state_dtype, pool_ref, P * per), fq_tolerance(c->dtype, FQ_TOL_OUT));
        free(o_ref);

        /* chunked forward on the same tokens from the same initial states
         * (no padding: every sequence uses slot P-1-n) == recurrent */
        void *o2 = alloc_arr(p->dtype, On);
        void *h0 = alloc_arr(p->state_dtype, N * per), *ht = alloc_arr(p->state_dtype, N * per);
        for (int64_t n = 0; n < N; n++) {
            slots[n] = P - 1 - n;
            slots32[n] = (int32_t)slots[n];
            for (int64_t i = 0; i < per; i++)
                set1(h0, p->state_dtype, n * per + i, pool_init[(P - 1 - n) * per + i]);
        }
        for (int64_t i = 0; i < P * per; i++) set1(pool, p->state_dtype, i, pool_init[i]);
        poison(in.o, p->dtype, On);
        poison(o2, p->dtype, On);
        poison(ht, p->state_dtype, N * per);
        st = fq_cpu_recurrent(p);
        fq_gdn_params pf = *p;
        pf.state = NULL;
        pf.state_indices = NULL;
        pf.P = 0;
        pf.h0 = h0;
        pf.ht = ht;
        pf.o = o2;
        fq_status st2 = fq_cpu_chunk_fwd(&pf);
        if (st != FQ_OK || st2 != FQ_OK) {
            printf("fwd==rec %s: status %d/%d: %s  FAIL\n", c->name, st, st2, fq_last_error());
            failures++;
        } else {
            /* compare as doubles: o2 vs o, ht vs pool slots */
            double *oref = malloc((size_t)(On > 0 ? On : 1) * sizeof(double));
            double *sref = malloc((size_t)(N * per) * sizeof(double));
            for (int64_t i = 0; i < On; i++) oref[i] = fq_cpu_load1(in.o, p->dtype, i);
            for (int64_t n = 0; n < N; n++)
                for (int64_t i = 0; i < per; i++)
                    sref[n * per + i] = fq_cpu_load1(pool, p->state_dtype, (P - 1 - n) * per + i);
            report("fwd==rec", c->name, rel_err(o2, p->dtype, oref, On),
                   rel_err(ht, p->state_dtype, sref, N * per), fq_tolerance(c->dtype, FQ_TOL_OUT));
            free(oref);
            free(sref);
        }
        free(o2);
        free(h0);
        free(ht);
    }
    free(slots);
    free(slots32);
    free(pool);
    free(pool_ref);
    free(pool_init);
    free_inputs(&in);
}

/* rejected shapes / dtypes: status and message, nothing written */
static void check_errors(void)
{
    fq_case c = {"err", FQ_F32, FQ_F32, 1, 10, 1, 1, 64, 64, 0, {0}, 1, 1, 0, 1.0, 0};
    int bad = 0;
    int64_t Ks[2][2] = {{8, 64}, {64, 300}};
    for (int i = 0; i < 2; i++) {
        c.K = Ks[i][0];
        c.V = Ks[i][1];
        fq_inputs in;
        make_inputs(&c, &in);
        fq_status st = fq_cpu_chunk_fwd(&in.p);
        const char *want = i == 0 ? "q:" : "v:";
        if (st != FQ_ERR_VALUE || strncmp(fq_last_error(), want, 2) != 0) bad++;
        printf("error     K=%lld V=%lld -> %d \"%s\"\n", (long long)c.K, (long long)c.V, st, fq_last_error());
        free_inputs(&in);
    }
    c.K = c.V = 64;
    c.gate_dtype = FQ_BF16; /* dtype F32, gates BF16: not allowed */
    fq_inputs in;
    make_inputs(&c, &in);
    fq_status st = fq_cpu_chunk_fwd(&in.p);
    printf("error     gate bf16 with f32 -> %d \"%s\"\n", st, fq_last_error());
    if (st != FQ_ERR_TYPE) bad++;
    free_inputs(&in);
    if (bad) failures++;
    printf("error     checks %s\n", bad ? "FAIL" : "ok");
}

int main(int argc, char **argv)
{
    int small = argc > 1 && strcmp(argv[1], "small") == 0;
    {
        const char *isa = NULL;
        if (fq_cpu_isa(&isa) == FQ_OK) printf("CPU kernel set: %s\n", isa);
        else printf("CPU kernel set: none (%s)\n", fq_last_error());
    }
    /* name, dtype, gate, B, T, H, HV, K, V, nseq, lens, h0, ht, l2norm, A_max, cu64 */
    fq_case cases[] = {
        {"f32 B2 T200 H2 HV2 K=V=64 h0 A16", FQ_F32, FQ_F32, 2, 200, 2, 2, 64, 64, 0, {0}, 1, 1, 0, 16, 0},
        {"f32 T200 GVA2 K=V=128 no h0 A0", FQ_F32, FQ_F32, 1, 200, 2, 4, 128, 128, 0, {0}, 0, 1, 0, 0, 0},
        {"f32 varlen 1,63,64,0,65,1000 GVA4", FQ_F32, FQ_F32, 1, 0, 1, 4, 64, 64, 6, {1, 63, 64, 0, 65, 1000}, 1, 1, 0, 8, 0},
        {"f32 varlen i64 GVA1 l2norm K=128 V=64", FQ_F32, FQ_F32, 1, 0, 2, 2, 128, 64, 4, {65, 0, 1, 130}, 1, 1, 1, 16, 1},
        {"f32 T300 K=V=256 h0 A4", FQ_F32, FQ_F32, 1, 300, 1, 2, 256, 256, 0, {0}, 1, 1, 0, 4, 0},
        {"f32 T1 B3 (decode-sized)", FQ_F32, FQ_F32, 3, 1, 2, 4, 128, 128, 0, {0}, 1, 1, 0, 16, 0},
        {"f32 T77 K=48 V=80 l2norm no ht", FQ_F32, FQ_F32, 1, 77, 1, 1, 48, 80, 0, {0}, 1, 0, 1, 2, 0},
        {"f32 T1000 K=V=128 A16 (strong decay)", FQ_F32, FQ_F32, 1, 1000, 1, 2, 128, 128, 0, {0}, 1, 1, 0, 16, 0},
        {"bf16 T200 GVA2 K=V=128 h0 A16", FQ_BF16, FQ_F32, 1, 200, 2, 4, 128, 128, 0, {0}, 1, 1, 0, 16, 0},
        {"bf16 gates bf16 varlen l2norm", FQ_BF16, FQ_BF16, 1, 0, 1, 2, 64, 64, 3, {100, 1, 70}, 1, 1, 1, 8, 0},
        {"f16 T130 K=V=64 h0", FQ_F16, FQ_F32, 1, 130, 1, 1, 64, 64, 0, {0}, 1, 1, 0, 8, 0},
        {"f64 T200 GVA2 K=128 V=64 h0 A16", FQ_F64, FQ_F64, 1, 200, 1, 2, 128, 64, 0, {0}, 1, 1, 0, 16, 0},
        {"f64 varlen l2norm gates f32", FQ_F64, FQ_F32, 1, 0, 1, 1, 64, 64, 3, {1, 0, 129}, 1, 1, 1, 4, 0},
    };
    fq_case small_cases[] = {
        {"f32 T70 K=V=32 h0", FQ_F32, FQ_F32, 1, 70, 1, 2, 32, 32, 0, {0}, 1, 1, 0, 4, 0},
        {"f32 varlen 1,0,65 K=16 V=48 l2norm", FQ_F32, FQ_F32, 1, 0, 1, 2, 16, 48, 3, {1, 0, 65}, 1, 1, 1, 8, 0},
        {"bf16 T9 K=V=32", FQ_BF16, FQ_F32, 2, 9, 1, 1, 32, 32, 0, {0}, 1, 1, 0, 4, 0},
        {"f64 T66 K=V=32", FQ_F64, FQ_F64, 1, 66, 1, 1, 32, 32, 0, {0}, 1, 1, 0, 4, 0},
    };
    fq_case *cs = small ? small_cases : cases;
    int ncs = small ? (int)(sizeof small_cases / sizeof *cs) : (int)(sizeof cases / sizeof *cs);
    for (int i = 0; i < ncs; i++) check_fwd(&cs[i], 2);
    if (!small) check_fwd(&cs[2], 1); /* the single-thread path too */

    /* recurrent cases: decode T=1, multi-token verify T=4, varlen, l2norm, dtypes */
    fq_case rcases[] = {
        {"f32 decode T1 N5 H2 HV4 K=V=128", FQ_F32, FQ_F32, 5, 1, 2, 4, 128, 128, 0, {0}, 0, 0, 0, 16, 0},
        {"f32 verify T4 N3 GVA2 K=128 V=64 l2norm", FQ_F32, FQ_F32, 3, 4, 1, 2, 128, 64, 0, {0}, 0, 0, 1, 8, 0},
        {"f32 varlen 3,1,0,8,70 K=V=64 A0", FQ_F32, FQ_F32, 1, 0, 1, 1, 64, 64, 5, {3, 1, 0, 8, 70}, 0, 0, 0, 0, 0},
        {"f32 T200 K=V=256 A16", FQ_F32, FQ_F32, 2, 200, 1, 1, 256, 256, 0, {0}, 0, 0, 0, 16, 0},
        {"f32 T5 K=48 V=80", FQ_F32, FQ_F32, 2, 5, 1, 1, 48, 80, 0, {0}, 0, 0, 0, 2, 0},
        {"bf16 decode T1 N4 GVA2", FQ_BF16, FQ_F32, 4, 1, 2, 4, 128, 128, 0, {0}, 0, 0, 0, 16, 0},
        {"bf16 gates bf16 T3 l2norm", FQ_BF16, FQ_BF16, 3, 3, 1, 2, 64, 64, 0, {0}, 0, 0, 1, 4, 0},
        {"f64 T6 N3 GVA2", FQ_F64, FQ_F64, 3, 6, 1, 2, 64, 32, 0, {0}, 0, 0, 0, 16, 0},
    };
    fq_case rsmall[] = {
        {"f32 T3 N3 K=V=32", FQ_F32, FQ_F32, 3, 3, 1, 2, 32, 32, 0, {0}, 0, 0, 0, 4, 0},
        {"f32 varlen 2,0,5 K=16 V=48 l2norm", FQ_F32, FQ_F32, 1, 0, 1, 1, 16, 48, 3, {2, 0, 5}, 0, 0, 1, 4, 0},
        {"f64 T2 N2", FQ_F64, FQ_F64, 2, 2, 1, 1, 32, 32, 0, {0}, 0, 0, 0, 4, 0},
    };
    cs = small ? rsmall : rcases;
    ncs = small ? (int)(sizeof rsmall / sizeof *cs) : (int)(sizeof rcases / sizeof *cs);
    for (int i = 0; i < ncs; i++) check_recurrent(&cs[i], 2, i % 2);
    if (!small) check_recurrent(&cs[0], 1, 0);
    check_errors();
    printf("%s: %d failure(s)\n", failures ? "FAILED" : "ALL OK", failures);
    return failures != 0;
}
