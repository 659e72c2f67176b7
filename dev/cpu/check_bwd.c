/*
 * check_bwd.c — checks fq_cpu_chunk_bwd against the float64 reverse mode (BPTT)
 * of the token-by-token recurrence (dev/cpu/reference.c, DESIGN §1), on
 * realistic inputs (DESIGN §3), with every output poisoned (NaN) first.
 *
 *   make -C dev check_bwd          builds dev/build/check_bwd and runs it
 *   dev/build/check_bwd            all cases; exit status 1 on any failure
 *   dev/build/check_bwd --small    a few small cases (for valgrind)
 *   dev/build/check_bwd --bench    time backward and forward at K=V=128
 *
 * Tolerances: the project's table (flashqla/reference.py, as
 * dev/build/tolerance.h), rel = ||out - ref||_2 / ||ref||_2. NaN never passes.
 */
#define _POSIX_C_SOURCE 199309L
#include "gdn.h"
#include "cpu/gdn_cpu.h"
#include "reference.h"
#include "tolerance.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* the forward is only needed for --bench; linked if present */
#pragma weak fq_cpu_chunk_fwd

/* ---------------------------------------------------------------- rng ---- */
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static double urand(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return ((rng_state >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}
static double randn(void)
{
    return sqrt(-2.0 * log(urand())) * cos(6.283185307179586 * urand());
}

/* ------------------------------------------------------ dtype buffers ---- */
static double rt(double x, fq_dtype dt) /* round-trip through dt */
{
    switch (dt) {
    case FQ_F32: return (float)x;
    case FQ_F16: return fq_cpu_f16_to_f32(fq_cpu_f32_to_f16((float)x));
    case FQ_BF16: return fq_cpu_bf16_to_f32(fq_cpu_f32_to_bf16((float)x));
    case FQ_F64: return x;
    }
    return x;
}
static void *to_dtype(const double *x, size_t n, fq_dtype dt)
{
    void *b = malloc(n * fq_dtype_size(dt) + 8);
    if (!b) { fprintf(stderr, "out of memory\n"); exit(2); }
    fq_cpu_store_f64(b, dt, 0, x, (int64_t)n);
    return b;
}
static void *poisoned(size_t n, fq_dtype dt)
{
    double *nan = malloc((n + 1) * sizeof *nan);
    for (size_t i = 0; i < n; i++) nan[i] = NAN;
    void *b = to_dtype(nan, n, dt);
    free(nan);
    return b;
}
static double *to_double(const void *b, size_t n, fq_dtype dt)
{
    double *x = malloc((n + 1) * sizeof *x);
    fq_cpu_load_f64(x, b, dt, 0, (int64_t)n);
    return x;
}

/* --------------------------------------------------------------- cases ---- */
typedef struct {
    const char *name;
    int64_t B, T, H, HV, K, V;
    const int64_t *lens; int nlens; /* cu_seqlens from lengths (B = 1) */
    fq_dtype dt, gdt;
    int has_h0, has_dht, l2;
    int decay; /* 0: A_h from 0 to 16 over heads, 1: all 0, 2: all 16 */
    int threads;
    int cu_int64;
} tcase;

static int run_case(const tcase *tc)
{
    const int64_t H = tc->H, HV = tc->HV, K = tc->K, V = tc->V;
    int64_t B = tc->B, T = tc->T, N;
    int64_t cu[64];
    if (tc->lens) {
        B = 1;
        N = tc->nlens;
        cu[0] = 0;
        for (int i = 0; i < tc->nlens; i++) cu[i + 1] = cu[i] + tc->lens[i];
        T = cu[N];
    } else {
        N = B;
    }
    const fq_dtype sdt = tc->dt == FQ_F64 ? FQ_F64 : FQ_F32;
    const size_t nq = B * T * H * K, nv = B * T * HV * V, ng = B * T * HV, ns = N * HV * K * V;
    double *q = malloc(nq * 8), *k = malloc(nq * 8), *v = malloc(nv * 8), *g = malloc(ng * 8);
    double *beta = malloc(ng * 8), *dO = malloc(nv * 8), *h0 = malloc((ns + 1) * 8);
    double *dht = malloc((ns + 1) * 8);
    for (size_t t = 0; t < (size_t)(B * T * H); t++) { /* q, k: unit rows unless l2 inside */
        double sq = 0, sk = 0;
        for (int64_t i = 0; i < K; i++) {
            q[t * K + i] = randn();
            k[t * K + i] = randn();
            sq += q[t * K + i] * q[t * K + i];
            sk += k[t * K + i] * k[t * K + i];
        }
        for (int64_t i = 0; i < K; i++) {
            if (!tc->l2) {
                q[t * K + i] /= sqrt(sq);
                k[t * K + i] /= sqrt(sk);
            }
            q[t * K + i] = rt(q[t * K + i], tc->dt);
            k[t * K + i] = rt(k[t * K + i], tc->dt);
        }
    }
    for (size_t i = 0; i < nv; i++) {
        v[i] = rt(randn(), tc->dt);
        dO[i] = rt(randn(), tc->dt);
    }
    for (size_t t = 0; t < (size_t)(B * T); t++)
        for (int64_t j = 0; j < HV; j++) {
            double Ah = tc->decay == 1 ? 0.0 : tc->decay == 2 ? 16.0
                        : (HV > 1 ? 16.0 * (double)j / (double)(HV - 1) : 1.0);
            double x = 0.5 * randn() + 1.0;
            g[t * HV + j] = rt(-Ah * log1p(exp(x)), tc->gdt);
            beta[t * HV + j] = rt(1.0 / (1.0 + exp(-randn())), tc->gdt);
        }
    for (size_t i = 0; i < ns; i++) {
        h0[i] = rt(randn(), sdt);
        dht[i] = rt(randn(), sdt);
    }
    const double scale = 1.0 / sqrt((double)K);

    /* ---- the kernel ---- */
    void *Q = to_dtype(q, nq, tc->dt), *Kb = to_dtype(k, nq, tc->dt), *Vb = to_dtype(v, nv, tc->dt);
    void *Gb = to_dtype(g, ng, tc->gdt), *Bb = to_dtype(beta, ng, tc->gdt);
    void *DO = to_dtype(dO, nv, tc->dt), *H0 = to_dtype(h0, ns, sdt), *DHT = to_dtype(dht, ns, sdt);
    void *DQ = poisoned(nq, tc->dt), *DK = poisoned(nq, tc->dt), *DV = poisoned(nv, tc->dt);
    void *DG = poisoned(ng, tc->gdt), *DB = poisoned(ng, tc->gdt), *DH0 = poisoned(ns, sdt);
    int32_t cu32[64];
    for (int i = 0; i <= N && tc->lens; i++) cu32[i] = (int32_t)cu[i];

    fq_gdn_params p;
    fq_params_init(&p);
    p.B = B; p.T = T; p.H = H; p.HV = HV; p.K = K; p.V = V; p.N = N;
    p.dtype = tc->dt; p.gate_dtype = tc->gdt; p.state_dtype = sdt;
    p.scale = scale; p.use_qk_l2norm = tc->l2;
    p.q = Q; p.k = Kb; p.v = Vb; p.g = Gb; p.beta = Bb;
    p.h0 = tc->has_h0 ? H0 : NULL;
    if (tc->lens) {
        p.cu_seqlens = tc->cu_int64 ? (const void *)cu : (const void *)cu32;
        p.cu_seqlens_is_int64 = tc->cu_int64;
    }
    p.dout = DO; p.dht = tc->has_dht ? DHT : NULL;
    p.dq = DQ; p.dk = DK; p.dv = DV; p.dg = DG; p.dbeta = DB;
    p.dh0 = tc->has_h0 ? DH0 : NULL;
    p.num_threads = tc->threads;
    fq_status st = fq_cpu_chunk_bwd(&p);
    if (st != FQ_OK) {
        printf("FAIL %-34s status %d: %s\n", tc->name, (int)st, fq_last_error());
        return 1;
    }

    /* ---- the reference ---- */
    double *rq = calloc(nq, 8), *rk = calloc(nq, 8), *rv = calloc(nv, 8), *rg = calloc(ng, 8);
    double *rb = calloc(ng, 8), *rh0 = calloc(ns + 1, 8);
    fq_ref_backward(&p, q, k, v, g, beta, tc->has_h0 ? h0 : NULL, dO, tc->has_dht ? dht : NULL, rq, rk,
                    rv, rg, rb, rh0);

    /* ---- compare ---- */
    double *oq = to_double(DQ, nq, tc->dt), *ok_ = to_double(DK, nq, tc->dt);
    double *ov = to_double(DV, nv, tc->dt), *og = to_double(DG, ng, tc->gdt);
    double *ob = to_double(DB, ng, tc->gdt), *oh = to_double(DH0, ns, sdt);
    const double tol = fq_tolerance(tc->dt, FQ_TOL_GRAD), tol_g = fq_tolerance(tc->dt, FQ_TOL_DG);
    double e[6] = {fq_ref_rel_error(oq, rq, nq), fq_ref_rel_error(ok_, rk, nq),
                   fq_ref_rel_error(ov, rv, nv), fq_ref_rel_error(og, rg, ng),
                   fq_ref_rel_error(ob, rb, ng), tc->has_h0 ? fq_ref_rel_error(oh, rh0, ns) : 0.0};
    double tols[6] = {tol, tol, tol, tol_g, tol, tol};
    int fail = 0;
    for (int i = 0; i < 6; i++)
        if (!(e[i] <= tols[i])) fail = 1; /* NaN fails */
    printf("%s %-34s dq %.1e dk %.1e dv %.1e dg %.1e db %.1e dh0 %s%.1e\n", fail ? "FAIL" : "ok  ",
           tc->name, e[0], e[1], e[2], e[3], e[4], tc->has_h0 ? "" : "(none) ", e[5]);

    free(q); free(k); free(v); free(g); free(beta); free(dO); free(h0); free(dht);
    free(Q); free(Kb); free(Vb); free(Gb); free(Bb); free(DO); free(H0); free(DHT);
    free(DQ); free(DK); free(DV); free(DG); free(DB); free(DH0);
    free(rq); free(rk); free(rv); free(rg); free(rb); free(rh0);
    free(oq); free(ok_); free(ov); free(og); free(ob); free(oh);
    return fail;
}

/* the validation path: bad params return a status, nothing crashes */
static int check_errors(void)
{
    float buf[4096] = {0};
    fq_gdn_params p;
    fq_params_init(&p);
    p.B = 1; p.T = 2; p.H = 1; p.HV = 1; p.K = 16; p.V = 16; p.N = 1;
    p.q = p.k = p.v = p.g = p.beta = p.dout = buf;
    p.dq = p.dk = p.dv = p.dg = p.dbeta = NULL;
    int fail = 0;
    if (fq_cpu_chunk_bwd(&p) != FQ_ERR_VALUE) fail = 1;
    p.dq = p.dk = p.dv = p.dg = p.dbeta = buf + 2048;
    p.h0 = buf; /* h0 without dh0 */
    if (fq_cpu_chunk_bwd(&p) != FQ_ERR_VALUE) fail = 1;
    printf("%s errors: missing outputs / dh0 rejected (\"%s\")\n", fail ? "FAIL" : "ok  ",
           fq_last_error());
    /* scratch that cannot exist (2^48 state elements per chunk): FQ_ERR_NOMEM,
     * before any output is touched. The outputs (64 MiB each at these sizes)
     * get addresses of their own, apart from the inputs and each other (the
     * core refuses written buffers that overlap anything, gdn_common.c); they
     * are never dereferenced. The one gate read (g <= 0) reads buf. */
    p.h0 = NULL;
    p.T = 1; p.K = (int64_t)1 << 24; p.V = (int64_t)1 << 24;
    {
        void **outs[5] = {&p.dq, &p.dk, &p.dv, &p.dg, &p.dbeta};
        for (int i = 0; i < 5; i++) *outs[i] = (void *)(uintptr_t)(((uint64_t)0x1000 + 2 * i) << 32);
    }
    fq_status st = fq_cpu_chunk_bwd(&p);
    int fail2 = st != FQ_ERR_NOMEM;
    printf("%s errors: huge scratch -> FQ_ERR_NOMEM (\"%s\")\n", fail2 ? "FAIL" : "ok  ",
           fq_last_error());
    return fail | fail2;
}

/* wall time; with one thread the calling thread's CPU time, which does not
 * count the time the scheduler gives to other processes */
static int bench_cpu_clock = 0;
static double now(void)
{
    struct timespec ts;
    clock_gettime(bench_cpu_clock ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static void bench(fq_dtype dt, int threads)
{
    const int64_t B = 1, T = 4096, H = 2, HV = 4, K = 128, V = 128;
    const size_t nq = B * T * H * K, nv = B * T * HV * V, ng = B * T * HV, ns = B * HV * K * V;
    double *x = malloc(nv * 8);
    for (size_t i = 0; i < nv; i++) x[i] = 0.1 * randn();
    double *gg = malloc(ng * 8), *bb = malloc(ng * 8);
    for (size_t i = 0; i < ng; i++) { gg[i] = -0.1 * urand(); bb[i] = 0.5; }
    void *q = to_dtype(x, nq, dt), *k = to_dtype(x + 7, nq, dt), *v = to_dtype(x, nv, dt);
    void *o = to_dtype(x, nv, dt), *dq = to_dtype(x, nq, dt), *dk = to_dtype(x, nq, dt);
    void *dv = to_dtype(x, nv, dt), *g = to_dtype(gg, ng, FQ_F32), *be = to_dtype(bb, ng, FQ_F32);
    void *dg = to_dtype(gg, ng, FQ_F32), *db = to_dtype(bb, ng, FQ_F32);
    void *h0 = to_dtype(x, ns, FQ_F32), *ht = to_dtype(x, ns, FQ_F32), *dh0 = to_dtype(x, ns, FQ_F32);
    fq_gdn_params p;
    fq_params_init(&p);
    p.B = B; p.T = T; p.H = H; p.HV = HV; p.K = K; p.V = V; p.N = B;
    p.dtype = dt; p.gate_dtype = FQ_F32; p.state_dtype = FQ_F32; p.scale = 1.0 / sqrt(K);
    p.use_qk_l2norm = 1;
    p.q = q; p.k = k; p.v = v; p.g = g; p.beta = be; p.h0 = h0; p.o = o; p.ht = ht;
    p.dout = v; p.dht = h0; p.dq = dq; p.dk = dk; p.dv = dv; p.dg = dg; p.dbeta = db; p.dh0 = dh0;
    p.num_threads = threads;
    bench_cpu_clock = threads == 1;
    double tb = 1e30, tf = 1e30;
    for (int it = 0; it < 9; it++) { /* interleaved, best of 9: the machine may be shared */
        double t0 = now();
        fq_cpu_chunk_bwd(&p);
        double t1 = now();
        if (t1 - t0 < tb) tb = t1 - t0;
        if (fq_cpu_chunk_fwd) {
            t0 = now();
            fq_cpu_chunk_fwd(&p);
            t1 = now();
            if (t1 - t0 < tf) tf = t1 - t0;
        }
    }
    printf("bench %s T=%lld H=%lld HV=%lld K=V=%lld threads=%d (%s): bwd %.2f ms (%.1f us/token/vhead)",
           fq_dtype_name(dt), (long long)T, (long long)H, (long long)HV, (long long)K, threads,
           bench_cpu_clock ? "thread CPU time" : "wall",
           1e3 * tb, 1e6 * tb / (T * HV) * (threads > 0 ? threads : 1));
    if (fq_cpu_chunk_fwd) printf("  fwd %.2f ms  bwd/fwd %.2f", 1e3 * tf, tb / tf);
    printf("\n");
    free(x); free(gg); free(bb);
    free(q); free(k); free(v); free(o); free(dq); free(dk); free(dv); free(g); free(be);
    free(dg); free(db); free(h0); free(ht); free(dh0);
}

int main(int argc, char **argv)
{
    static const int64_t lens[] = {1, 63, 64, 0, 65, 300};
    static const int64_t lens_small[] = {1, 0, 70};
    int small = argc > 1 && !strcmp(argv[1], "--small");
    {
        const char *isa = NULL;
        if (fq_cpu_isa(&isa) == FQ_OK) printf("CPU kernel set: %s\n", isa);
        else printf("CPU kernel set: none (%s)\n", fq_last_error());
    }
    if (argc > 1 && !strcmp(argv[1], "--bench")) {
        bench(FQ_F32, 1);
        bench(FQ_BF16, 1);
        bench(FQ_F32, 2);
        return 0;
    }
    const fq_dtype F64 = FQ_F64, F32 = FQ_F32, BF = FQ_BF16, F16 = FQ_F16;
    /* name, B, T, H, HV, K, V, lens, nlens, dt, gdt, h0, dht, l2, decay, threads, cu64 */
    const tcase cases[] = {
        {"f64 T200 GVA2 h0 dht l2", 2, 200, 2, 4, 64, 64, 0, 0, F64, F64, 1, 1, 1, 0, 2, 0},
        {"f64 varlen GVA4 K128 V64 dht", 1, 0, 1, 4, 128, 64, lens, 6, F64, F64, 0, 1, 0, 0, 3, 1},
        {"f64 varlen GVA4 mode-B h0", 1, 0, 1, 4, 64, 64, lens, 6, F64, F64, 1, 0, 1, 0, 8, 0},
        {"f64 T130 GVA1 zero decay h0", 1, 130, 3, 3, 64, 64, 0, 0, F64, F64, 1, 0, 1, 1, 2, 0},
        {"f64 T200 GVA2 strong decay", 1, 200, 2, 4, 64, 64, 0, 0, F64, F64, 1, 1, 0, 2, 1, 0},
        {"f64 T1 GVA2 no h0 no dht", 3, 1, 1, 2, 16, 32, 0, 0, F64, F64, 0, 0, 1, 0, 2, 0},
        {"f32 T200 GVA2 h0 dht l2", 2, 200, 2, 4, 64, 64, 0, 0, F32, F32, 1, 1, 1, 0, 2, 0},
        {"f32 varlen GVA4 K128 V64 h0 dht", 1, 0, 1, 4, 128, 64, lens, 6, F32, F32, 1, 1, 0, 0, 2, 0},
        {"f32 varlen GVA4 mode-B l2", 1, 0, 1, 4, 64, 64, lens, 6, F32, F32, 1, 1, 1, 0, 8, 1},
        {"f32 T130 GVA1 zero decay", 1, 130, 3, 3, 64, 64, 0, 0, F32, F32, 1, 0, 1, 1, 2, 0},
        {"f32 T200 GVA2 strong decay", 1, 200, 2, 4, 64, 64, 0, 0, F32, F32, 1, 1, 1, 2, 2, 0},
        {"f32 T300 K=V=256 GVA2", 1, 300, 1, 2, 256, 256, 0, 0, F32, F32, 1, 1, 1, 0, 2, 0},
        {"bf16 T200 GVA2 h0 dht l2", 2, 200, 2, 4, 64, 64, 0, 0, BF, F32, 1, 1, 1, 0, 2, 0},
        {"bf16 varlen GVA4 K128 V64", 1, 0, 1, 4, 128, 64, lens, 6, BF, F32, 1, 1, 0, 0, 2, 0},
        {"bf16 T200 bf16 gates GVA1", 1, 200, 2, 2, 64, 64, 0, 0, BF, BF, 1, 1, 1, 0, 2, 0},
        {"f16 T200 GVA2 K128 V64", 1, 200, 2, 4, 128, 64, 0, 0, F16, F32, 1, 1, 1, 0, 2, 0},
        {"f32 T100 K=48 V=80 GVA2", 1, 100, 1, 2, 48, 80, 0, 0, F32, F32, 1, 1, 1, 0, 2, 0},
        {"f64 T70 K=17 V=19 GVA3", 1, 70, 1, 3, 17, 19, 0, 0, F64, F64, 1, 1, 0, 0, 2, 0},
        {"f64 T=0 (dh0 = dht)", 2, 0, 1, 2, 16, 16, 0, 0, F64, F64, 1, 1, 1, 0, 2, 0},
        {"f32 threads=1 varlen GVA2", 1, 0, 2, 4, 64, 64, lens, 6, F32, F32, 1, 1, 1, 0, 1, 0},
    };
    const tcase small_cases[] = {
        {"f64 small varlen GVA2", 1, 0, 1, 2, 16, 16, lens_small, 3, F64, F64, 1, 1, 1, 0, 2, 0},
        {"f32 small varlen mode-B", 1, 0, 1, 2, 16, 24, lens_small, 3, F32, F32, 1, 1, 0, 0, 4, 1},
        {"bf16 small T70", 1, 70, 2, 2, 32, 16, 0, 0, BF, F32, 0, 1, 1, 0, 2, 0},
    };
    int fail = 0;
    const tcase *list = small ? small_cases : cases;
    int n = small ? (int)(sizeof small_cases / sizeof *small_cases) : (int)(sizeof cases / sizeof *cases);
    for (int i = 0; i < n; i++) fail |= run_case(&list[i]);
    fail |= check_errors();
    printf(fail ? "FAILED\n" : "all passed\n");
    return fail;
}
