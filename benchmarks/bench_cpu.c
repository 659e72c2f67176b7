/*
 * bench_cpu.c — CPU benchmark of the flashqla core, in plain C (no Python):
 * links csrc/gdn_common.c and the CPU backend files directly.
 *
 * Build and run from the repository root (portable flags, as pip's build):
 *
 *   make -C benchmarks bench_cpu
 *   benchmarks/bench_cpu [results-dir]     (default benchmarks/results)
 *
 * Measures, fp32, K = V = 128:
 *   prefill: fq_cpu_chunk_fwd, one 8192-token sequence, H = HV = 4, h0 given,
 *            final state requested (and the same with bf16 q, k, v, o);
 *   decode:  fq_cpu_recurrent, T = 1, 16 sequences, H = 16, HV = 32, state
 *            pool of 16 slots updated in place;
 * at 1 thread and at all threads: median wall time of several runs after a
 * warm-up, reported as M token-heads/s (tokens * HV / seconds) and per thread,
 * next to llama.cpp's ggml GDN op on this machine (0.27 prefill, 0.15 decode
 * M token-heads/s per thread). Inputs as in DESIGN §3.
 *
 * Every CPU kernel set this machine runs is measured (each in a child process
 * of this program with FLASHQLA_CPU_ISA set, ROUNDS rounds interleaved, the
 * median per number), as is the clock (a chain of dependent integer adds, one
 * per cycle, timed; before and after each child) and the FMA throughput of
 * the vector unit (independent ymm / zmm FMA chains). Prefill % of peak =
 * 183 kFLOP per token-head (the anchor's nominal count, NOTES.md) x rate /
 * (FMA lanes per cycle x 2 x GHz). Writes <results-dir>/cpu_<YYYY-MM-DD>.json
 * with "paths" (one entry per set) and "rows" (the default set's runs).
 *
 *   benchmarks/bench_cpu [results-dir] [rounds] [quiet-wait-s]
 *
 * (default 3 rounds; before each child it waits up to quiet-wait-s = 120 s
 * for 2 s in which the cores are >= 95 % idle, and records the idle share)
 */
#define _POSIX_C_SOURCE 200809L
#include "cpu/gdn_cpu.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define BENCH_FLAGS "-std=c11 -O3 -fno-math-errno -ffp-contract=fast -pthread"

static uint64_t rng = 0x243f6a8885a308d3ull;

static double urand(void)
{
    uint64_t z = (rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return ((z >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

static double randn(void) { return sqrt(-2.0 * log(urand())) * cos(6.283185307179586 * urand()); }

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static float *falloc(int64_t n)
{
    float *a = aligned_alloc(64, ((size_t)n * sizeof(float) + 63) / 64 * 64);
    if (!a) {
        fprintf(stderr, "bench_cpu: out of memory\n");
        exit(2);
    }
    return a;
}

/* rows of d randn values, L2-normalised if unit */
static void fill_rows(float *x, int64_t rows, int64_t d, int unit, double mul)
{
    for (int64_t r = 0; r < rows; r++) {
        double ss = 0;
        for (int64_t i = 0; i < d; i++) {
            x[r * d + i] = (float)randn();
            ss += (double)x[r * d + i] * x[r * d + i];
        }
        double f = unit ? mul / sqrt(ss) : mul;
        for (int64_t i = 0; i < d; i++) x[r * d + i] = (float)(x[r * d + i] * f);
    }
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

typedef struct {
    const char *work;
    int64_t H, HV, T, N;
    int threads;
    double seconds, mth, per_thread, ggml;
    double cpu_seconds; /* process CPU time of the median run (all threads) */
} bench_row;

/* Inputs of DESIGN §3: q, k unit rows; beta = sigmoid(randn);
 * g = -A_h softplus(0.5 randn + 1), A_h spread over 0.5 .. 16 across heads. */
static void make_inputs(fq_gdn_params *p, int64_t B, int64_t T, int64_t H, int64_t HV, int64_t K,
                        int64_t V)
{
    fq_params_init(p);
    p->B = B;
    p->T = T;
    p->N = B;
    p->H = H;
    p->HV = HV;
    p->K = K;
    p->V = V;
    p->scale = 1.0 / sqrt((double)K);
    float *q = falloc(B * T * H * K), *k = falloc(B * T * H * K), *v = falloc(B * T * HV * V);
    float *g = falloc(B * T * HV), *beta = falloc(B * T * HV), *o = falloc(B * T * HV * V);
    fill_rows(q, B * T * H, K, 1, 1.0);
    fill_rows(k, B * T * H, K, 1, 1.0);
    fill_rows(v, B * T * HV, V, 0, 1.0);
    for (int64_t t = 0; t < B * T; t++)
        for (int64_t j = 0; j < HV; j++) {
            double A = 0.5 + 15.5 * (double)j / (double)(HV > 1 ? HV - 1 : 1);
            double x = 0.5 * randn() + 1.0;
            g[t * HV + j] = (float)(-A * (x > 20 ? x : log1p(exp(x))));
            beta[t * HV + j] = (float)(1.0 / (1.0 + exp(-randn())));
        }
    memset(o, 0, (size_t)(B * T * HV * V) * sizeof(float));
    p->q = q;
    p->k = k;
    p->v = v;
    p->g = g;
    p->beta = beta;
    p->o = o;
}

static void free_inputs(fq_gdn_params *p)
{
    free((void *)p->q);
    free((void *)p->k);
    free((void *)p->v);
    free((void *)p->g);
    free((void *)p->beta);
    free(p->o);
}

static double cpu_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* median wall seconds of `runs` calls after `warm` warm-up calls; *cpu gets
 * the median process CPU seconds (threads summed) */
static double time_calls(fq_status (*fn)(const fq_gdn_params *), fq_gdn_params *p, int warm, int runs,
                         double *cpu)
{
    double ts[64], cs[64];
    for (int i = 0; i < warm; i++)
        if (fn(p) != FQ_OK) {
            fprintf(stderr, "bench_cpu: call failed: %s\n", fq_last_error());
            exit(1);
        }
    for (int i = 0; i < runs; i++) {
        double c0 = cpu_now(), t0 = now();
        fn(p);
        ts[i] = now() - t0;
        cs[i] = cpu_now() - c0;
    }
    qsort(ts, (size_t)runs, sizeof *ts, cmp_double);
    qsort(cs, (size_t)runs, sizeof *cs, cmp_double);
    *cpu = cs[runs / 2];
    return ts[runs / 2];
}

static void cpu_model(char *buf, size_t n)
{
    snprintf(buf, n, "unknown");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "model name", 10) == 0) {
            char *c = strchr(line, ':');
            if (c) {
                c++;
                while (*c == ' ' || *c == '\t') c++;
                c[strcspn(c, "\n")] = 0;
                snprintf(buf, n, "%s", c);
            }
            break;
        }
    }
    fclose(f);
}

/* ------------------------------------------------- clock and peak ---- */

#define BENCH_FLOP_PER_TOKEN_HEAD 183e3 /* the anchor's nominal count at K = V = 128, C = 64 */

/* CPU time of this thread: the clock and FMA loops count cycles per second
 * actually run, whatever share of the cores the neighbours leave us */
static double thread_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* GHz from a chain of dependent adds (1 cycle each), ~50 ms, median of 5 */
static double measure_ghz(void)
{
    double g[5];
    for (int r = 0; r < 5; r++) {
        uint64_t x = 0;
        const uint64_t n = 200000000;
        double t0 = thread_now();
        for (uint64_t i = 0; i < n; i += 8) {
#if defined(__x86_64__)
            __asm__ volatile("add $1,%0\n\tadd $1,%0\n\tadd $1,%0\n\tadd $1,%0\n\t"
                             "add $1,%0\n\tadd $1,%0\n\tadd $1,%0\n\tadd $1,%0" : "+r"(x));
#elif defined(__aarch64__)
            __asm__ volatile("add %0,%0,#1\n\tadd %0,%0,#1\n\tadd %0,%0,#1\n\tadd %0,%0,#1\n\t"
                             "add %0,%0,#1\n\tadd %0,%0,#1\n\tadd %0,%0,#1\n\tadd %0,%0,#1" : "+r"(x));
#else
            return 0.0;
#endif
        }
        g[r] = (double)x / (thread_now() - t0) / 1e9;
    }
    qsort(g, 5, sizeof *g, cmp_double);
    return g[2];
}

#if defined(__x86_64__)
/* FLOP per second of 12 independent FMA chains, ymm or zmm */
__attribute__((target("avx2,fma"))) static double fma_rate_ymm(void)
{
    __m256 a[12], b = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
    for (int i = 0; i < 12; i++) a[i] = _mm256_set1_ps((float)i);
    const long n = 20000000;
    double t0 = thread_now();
    for (long it = 0; it < n; it++)
        for (int i = 0; i < 12; i++) a[i] = _mm256_fmadd_ps(a[i], b, c);
    double t = thread_now() - t0;
    float sink = 0;
    for (int i = 0; i < 12; i++) sink += _mm256_cvtss_f32(a[i]);
    if (sink == 12345.0f) printf(" ");
    return (double)n * 12 * 8 * 2 / t;
}
__attribute__((target("avx512f"))) static double fma_rate_zmm(void)
{
    __m512 a[12], b = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
    for (int i = 0; i < 12; i++) a[i] = _mm512_set1_ps((float)i);
    const long n = 10000000;
    double t0 = thread_now();
    for (long it = 0; it < n; it++)
        for (int i = 0; i < 12; i++) a[i] = _mm512_fmadd_ps(a[i], b, c);
    double t = thread_now() - t0;
    float sink = 0;
    for (int i = 0; i < 12; i++) sink += _mm512_cvtss_f32(a[i]);
    if (sink == 12345.0f) printf(" ");
    return (double)n * 12 * 16 * 2 / t;
}
#endif

static double median3(double *x, int n)
{
    qsort(x, (size_t)n, sizeof *x, cmp_double);
    return x[n / 2];
}

/* --------------------------------------------------- one kernel set ---- */

static uint16_t *to_bf16(const float *x, int64_t n)
{
    uint16_t *h = malloc((size_t)n * sizeof *h);
    if (!h) {
        fprintf(stderr, "bench_cpu: out of memory\n");
        exit(2);
    }
    for (int64_t i = 0; i < n; i++) h[i] = fq_cpu_f32_to_bf16(x[i]);
    return h;
}

/* The rows of the active kernel set (one child process). */
static int run_rows(bench_row *rows, int with_bf16)
{
    const int K = 128, V = 128;
    const int all = fq_cpu_default_threads();
    int thread_counts[2] = {1, all};
    int n_tc = all > 1 ? 2 : 1;
    int nrows = 0;

    /* (a) prefill: one 8192-token sequence, H = HV = 4, h0 given, ht requested */
    {
        const int64_t T = 8192, H = 4, HV = 4;
        fq_gdn_params p;
        make_inputs(&p, 1, T, H, HV, K, V);
        float *h0 = falloc(HV * K * V), *ht = falloc(HV * K * V);
        fill_rows(h0, HV * K, V, 0, 0.1);
        p.h0 = h0;
        p.ht = ht;
        for (int c = 0; c < n_tc; c++) {
            p.num_threads = thread_counts[c];
            double cpu, s = time_calls(fq_cpu_chunk_fwd, &p, 1, 7, &cpu);
            double mth = (double)T * HV / s / 1e6;
            rows[nrows++] = (bench_row){"prefill", H, HV, T, 1, thread_counts[c], s, mth,
                                        mth / thread_counts[c], 0.27, cpu};
        }
        if (with_bf16) { /* the same with bf16 q, k, v, o (converted in the tile loads) */
            fq_gdn_params b = p;
            uint16_t *q = to_bf16(p.q, T * H * K), *k = to_bf16(p.k, T * H * K);
            uint16_t *v = to_bf16(p.v, T * HV * V), *o = to_bf16(p.o, T * HV * V);
            b.dtype = FQ_BF16;
            b.q = q;
            b.k = k;
            b.v = v;
            b.o = o;
            b.num_threads = 1;
            double cpu, s = time_calls(fq_cpu_chunk_fwd, &b, 1, 7, &cpu);
            double mth = (double)T * HV / s / 1e6;
            rows[nrows++] = (bench_row){"prefill_bf16", H, HV, T, 1, 1, s, mth, mth, 0.27, cpu};
            free(q);
            free(k);
            free(v);
            free(o);
        }
        free(h0);
        free(ht);
        free_inputs(&p);
    }

    /* (b) decode: T = 1, 16 sequences, H = 16, HV = 32, pool of 16 slots */
    {
        const int64_t N = 16, H = 16, HV = 32;
        fq_gdn_params p;
        make_inputs(&p, N, 1, H, HV, K, V);
        float *pool = falloc(N * HV * K * V);
        fill_rows(pool, N * HV * K, V, 0, 0.1);
        p.state = pool;
        p.P = N;
        for (int c = 0; c < n_tc; c++) {
            p.num_threads = thread_counts[c];
            double cpu, s = time_calls(fq_cpu_recurrent, &p, 3, 31, &cpu);
            double mth = (double)N * HV / s / 1e6;
            rows[nrows++] = (bench_row){"decode", H, HV, 1, N, thread_counts[c], s, mth,
                                        mth / thread_counts[c], 0.15, cpu};
        }
        free(pool);
        free_inputs(&p);
    }
    return nrows;
}

/* child: print the rows of the active set, one per line */
static int child_main(void)
{
    const char *isa = NULL;
    if (fq_cpu_isa(&isa) != FQ_OK) {
        printf("refused %s\n", fq_last_error());
        return 3;
    }
    bench_row rows[8];
    int n = run_rows(rows, 1);
    for (int i = 0; i < n; i++)
        printf("row %s %s %d %.9g %.9g\n", isa, rows[i].work, rows[i].threads, rows[i].seconds,
               rows[i].cpu_seconds);
    return 0;
}

static double load_average(void)
{
    double load[3] = {-1, -1, -1};
    FILE *lf = fopen("/proc/loadavg", "r");
    if (lf) {
        if (fscanf(lf, "%lf %lf %lf", &load[0], &load[1], &load[2]) != 3) load[0] = -1;
        fclose(lf);
    }
    return load[0];
}

/* Share of the machine's CPU time idle over `ms` milliseconds (/proc/stat;
 * -1 where there is none). */
static double idle_share(int ms)
{
    unsigned long long v0[10] = {0}, v1[10] = {0};
    for (int pass = 0; pass < 2; pass++) {
        FILE *f = fopen("/proc/stat", "r");
        if (!f) return -1;
        unsigned long long *v = pass ? v1 : v0;
        if (fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3], &v[4],
                   &v[5], &v[6], &v[7]) != 8) {
            fclose(f);
            return -1;
        }
        fclose(f);
        if (!pass) {
            struct timespec sl = {ms / 1000, (long)(ms % 1000) * 1000000L};
            nanosleep(&sl, NULL);
        }
    }
    unsigned long long tot = 0, idle = (v1[3] - v0[3]) + (v1[4] - v0[4]);
    for (int i = 0; i < 8; i++) tot += v1[i] - v0[i];
    return tot ? (double)idle / (double)tot : -1;
}

/* Waits (up to max_s seconds) for 2 s in which the cores are >= 95 % idle;
 * returns the idle share of the last 2 s looked at. */
static double wait_quiet(int max_s)
{
    double q = idle_share(2000);
    for (int waited = 2; q >= 0 && q < 0.95 && waited < max_s; waited += 2) q = idle_share(2000);
    return q;
}

#define MAX_ROUNDS 9
static const char *SETS[] = {"avx512", "avx2", "neon", "scalar"};
enum { NSETS = 4, NWORK = 5 }; /* prefill 1 / all, prefill_bf16, decode 1 / all */

typedef struct {
    int ran, refused;
    char why[320];
    double sec[NWORK][MAX_ROUNDS], cpu[NWORK][MAX_ROUNDS];
    double idle[MAX_ROUNDS]; /* the cores' idle share just before each round's child */
    int threads[NWORK];
    const char *work[NWORK];
    int nwork;
} set_result;

static void run_child(const char *argv0, const char *isa, set_result *r, int round)
{
    char cmd[1024];
    setenv("FLASHQLA_CPU_ISA", isa, 1);
    snprintf(cmd, sizeof cmd, "'%s' --one", argv0);
    FILE *pp = popen(cmd, "r");
    unsetenv("FLASHQLA_CPU_ISA");
    if (!pp) return;
    char line[512];
    int w = 0;
    while (fgets(line, sizeof line, pp)) {
        if (strncmp(line, "refused ", 8) == 0) {
            r->refused = 1;
            snprintf(r->why, sizeof r->why, "%.300s", line + 8);
            r->why[strcspn(r->why, "\n")] = 0;
            continue;
        }
        char got[32], work[32];
        int th;
        double sec, cpu;
        if (sscanf(line, "row %31s %31s %d %lf %lf", got, work, &th, &sec, &cpu) == 5 && w < NWORK) {
            r->sec[w][round] = sec;
            r->cpu[w][round] = cpu;
            r->threads[w] = th;
            r->work[w] = strcmp(work, "prefill") == 0 ? "prefill"
                         : strcmp(work, "prefill_bf16") == 0 ? "prefill_bf16" : "decode";
            w++;
        }
    }
    pclose(pp);
    if (w > 0) {
        r->ran = 1;
        r->nwork = w;
    }
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "--one") == 0) return child_main();
    const char *outdir = argc > 1 ? argv[1] : "benchmarks/results";
    int rounds = argc > 2 ? atoi(argv[2]) : 3;
    const int quiet_s = argc > 3 ? atoi(argv[3]) : 120; /* longest wait for quiet cores per run */
    if (rounds < 1) rounds = 1;
    if (rounds > MAX_ROUNDS) rounds = MAX_ROUNDS;
    const int all = fq_cpu_default_threads();
    const char *default_isa = "none";
    if (fq_cpu_isa(&default_isa) != FQ_OK) default_isa = "none";
    const double load0 = load_average();

    /* the vector unit: FMA FLOP per cycle of ymm / zmm chains */
    double ghz_list[2 * MAX_ROUNDS * NSETS + 2];
    int nghz = 0;
    ghz_list[nghz++] = measure_ghz();
    double ymm = 0, zmm = 0;
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) ymm = fma_rate_ymm();
    if (__builtin_cpu_supports("avx512f")) zmm = fma_rate_zmm();
#endif

    set_result res[NSETS];
    memset(res, 0, sizeof res);
    for (int round = 0; round < rounds; round++)
        for (int s = 0; s < NSETS; s++) {
            if (round > 0 && !res[s].ran) continue;
            res[s].idle[round] = wait_quiet(quiet_s);
            run_child(argv[0], SETS[s], &res[s], round);
            ghz_list[nghz++] = measure_ghz();
        }
    const double load1 = load_average();
    const double ghz = median3(ghz_list, nghz);
    /* the peak: FMA lanes per cycle (measured ymm rate, rounded to a power of
     * two lanes) x 2 FLOP x GHz */
    const double best = ymm > zmm ? ymm : zmm;
    int lanes_per_cycle = 0; /* FMA lanes completed per cycle */
    if (best > 0 && ghz > 0) {
        double l = best / 2 / (ghz * 1e9);
        lanes_per_cycle = 1;
        while (lanes_per_cycle * 1.5 < l) lanes_per_cycle *= 2;
    }
    const double peak = lanes_per_cycle * 2.0 * ghz * 1e9;

    printf("clock %.3f GHz (dependent adds, median of %d), FMA: ymm %.1f, zmm %.1f FLOP/cycle; "
           "peak assumed %d FMA lanes/cycle x 2 x %.3f GHz = %.1f GFLOP/s\n",
           ghz, nghz, ymm / (ghz * 1e9), zmm / (ghz * 1e9), lanes_per_cycle, ghz, peak / 1e9);
    printf("%-7s %-13s %7s %10s %14s %11s %8s %14s\n", "set", "work", "threads", "ms",
           "Mtok-heads/s", "per thread", "of peak", "per CPU-second");
    double pv[NSETS][NWORK], pc[NSETS][NWORK];
    for (int s = 0; s < NSETS; s++) {
        if (!res[s].ran) {
            printf("%-7s refused: %s\n", SETS[s], res[s].why);
            continue;
        }
        for (int w = 0; w < res[s].nwork; w++) {
            int n = 0;
            double tmp[MAX_ROUNDS], tc[MAX_ROUNDS];
            for (int r = 0; r < rounds; r++)
                if (res[s].sec[w][r] > 0) {
                    tmp[n] = res[s].sec[w][r];
                    tc[n++] = res[s].cpu[w][r];
                }
            pv[s][w] = n ? median3(tmp, n) : 0;
            pc[s][w] = n ? median3(tc, n) : 0;
            const int dec = strcmp(res[s].work[w], "decode") == 0;
            const double units = dec ? 16.0 * 32 : 8192.0 * 4;
            const double mth = units / pv[s][w] / 1e6, per = mth / res[s].threads[w];
            printf("%-7s %-13s %7d %10.3f %14.3f %11.3f %7.1f%% %14.3f\n", SETS[s], res[s].work[w],
                   res[s].threads[w], pv[s][w] * 1e3, mth, per,
                   dec ? 0.0 : 100.0 * per * 1e6 * BENCH_FLOP_PER_TOKEN_HEAD / peak,
                   units / pc[s][w] / 1e6);
        }
    }
    printf("load average: %.2f before, %.2f after (other processes share these cores; medians "
           "of %d interleaved rounds)\nidle share of the cores before each run:", load0, load1, rounds);
    for (int s = 0; s < NSETS; s++)
        if (res[s].ran) {
            printf(" %s", SETS[s]);
            for (int r = 0; r < rounds; r++) printf(" %.2f", res[s].idle[r]);
        }
    printf("\n");

    char model[256], date[32], path[512];
    cpu_model(model, sizeof model);
    time_t tt = time(NULL);
    struct tm tmv;
    localtime_r(&tt, &tmv);
    strftime(date, sizeof date, "%Y-%m-%d", &tmv);
    snprintf(path, sizeof path, "%s/cpu_%s.json", outdir, date);
    FILE *f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "bench_cpu: cannot write %s\n", path);
        return 1;
    }
#if defined(__clang__)
    const char *compiler = "clang " __clang_version__;
#elif defined(__GNUC__)
    const char *compiler = "gcc " __VERSION__;
#else
    const char *compiler = "unknown";
#endif
    fprintf(f, "{\n  \"machine\": \"%s\",\n  \"threads_available\": %d,\n", model, all);
    fprintf(f, "  \"compiler\": \"%s\",\n  \"flags\": \"%s\",\n  \"date\": \"%s\",\n", compiler,
            BENCH_FLAGS, date);
    fprintf(f, "  \"load_average_1min\": [%.2f, %.2f],\n  \"rounds\": %d,\n", load0, load1, rounds);
    fprintf(f, "  \"clock\": {\"ghz\": %.3f, \"method\": \"a chain of dependent 64-bit integer "
               "adds (1 per cycle) timed in thread CPU time, ~50 ms x 5 (median), before the "
               "runs and after each child; the median of all %d\"},\n", ghz, nghz);
    fprintf(f, "  \"peak\": {\"fma_lanes_per_cycle\": %d, \"flop_per_fma\": 2, \"ghz\": %.3f, "
               "\"gflops\": %.2f, \"measured_fma_flop_per_cycle\": {\"ymm\": %.2f, \"zmm\": %.2f}, "
               "\"note\": \"the fp32 FMA peak of the vector unit: lanes per cycle from 12 "
               "independent FMA chains (Zen 4: 2 pipes x 8 lanes, a zmm FMA as two halves); "
               "pct_of_peak = 183 kFLOP per token-head x prefill rate / this\"},\n",
            lanes_per_cycle, ghz, peak / 1e9, ymm / (ghz * 1e9), zmm / (ghz * 1e9));
    fprintf(f, "  \"notes\": [\"183 kFLOP per token-head is the nominal count (every product full); the "
               "multiply-adds executed, with the triangular ones halved, are about 145 kFLOP, so 89 %% "
               "nominal is about 71 %% of the executed peak\", \"scalar is baseline x86-64 here (SSE2, no FMA: "
               "a multiply and an add per lane, at most 50 %% of the FMA peak)\", \"ggml (llama.cpp) on this "
               "machine type: prefill 0.27, decode 0.15 (1 thread) / 0.14 (2 threads) M token-heads/s per "
               "thread, ../../shared/ANCHORS.md\"],\n");
    fprintf(f, "  \"default_isa\": \"%s\",\n  \"paths\": [\n", default_isa);
    int first = 1;
    for (int s = 0; s < NSETS; s++) {
        if (!res[s].ran) continue;
        double pre1 = 0, preall = 0, bf = 0, dec1 = 0, decall = 0;
        int tall = 1;
        for (int w = 0; w < res[s].nwork; w++) {
            const int dec = strcmp(res[s].work[w], "decode") == 0;
            const double units = dec ? 16.0 * 32 : 8192.0 * 4;
            const double per = units / pv[s][w] / 1e6 / res[s].threads[w];
            if (strcmp(res[s].work[w], "prefill_bf16") == 0) bf = per;
            else if (!dec && res[s].threads[w] == 1) pre1 = per;
            else if (!dec) preall = per, tall = res[s].threads[w];
            else if (res[s].threads[w] == 1) dec1 = per;
            else decall = per;
        }
        char idles[128] = "";
        for (int r = 0; r < rounds; r++)
            snprintf(idles + strlen(idles), sizeof idles - strlen(idles), "%s%.2f", r ? ", " : "",
                     res[s].idle[r]);
        fprintf(f, "%s    {\"isa\": \"%s\", \"prefill_mtokheads_per_thread\": %.4f, "
                   "\"pct_of_peak\": %.1f, \"decode_mtokheads_per_thread\": %.4f, \"threads\": 1, "
                   "\"prefill_bf16_mtokheads_per_thread\": %.4f, \"prefill_gflops\": %.2f, "
                   "\"all_threads\": {\"threads\": %d, \"prefill_mtokheads_per_thread\": %.4f, "
                   "\"decode_mtokheads_per_thread\": %.4f, \"decode_speedup_vs_1_thread\": %.3f}, "
                   "\"idle_share_before_each_round\": [%s]}",
                first ? "" : ",\n", SETS[s], pre1, 100.0 * pre1 * 1e6 * BENCH_FLOP_PER_TOKEN_HEAD / peak,
                dec1, bf, pre1 * 1e6 * BENCH_FLOP_PER_TOKEN_HEAD / 1e9, tall, preall, decall,
                dec1 > 0 ? decall * tall / dec1 : 0.0, idles);
        first = 0;
    }
    fprintf(f, "\n  ],\n  \"rows\": [\n");
    /* the default set's runs, in the shape of the earlier files */
    first = 1;
    for (int s = 0; s < NSETS; s++) {
        if (!res[s].ran || strcmp(SETS[s], default_isa) != 0) continue;
        for (int w = 0; w < res[s].nwork; w++) {
            const int dec = strcmp(res[s].work[w], "decode") == 0;
            const double units = dec ? 16.0 * 32 : 8192.0 * 4;
            const double mth = units / pv[s][w] / 1e6;
            fprintf(f,
                    "%s    {\"work\": \"%s\", \"H\": %d, \"HV\": %d, \"T\": %d, \"N\": %d, "
                    "\"threads\": %d, \"seconds\": %.6g, \"mtoken_heads_per_s\": %.4f, "
                    "\"per_thread\": %.4f, \"ggml_per_thread\": %.2f, \"cpu_seconds\": %.6g}",
                    first ? "" : ",\n", res[s].work[w], dec ? 16 : 4, dec ? 32 : 4, dec ? 1 : 8192,
                    dec ? 16 : 1, res[s].threads[w], pv[s][w], mth, mth / res[s].threads[w],
                    dec ? 0.15 : 0.27, pc[s][w]);
            first = 0;
        }
    }
    fprintf(f, "\n  ]\n}\n");
    fclose(f);
    printf("wrote %s\n", path);
    return 0;
}
