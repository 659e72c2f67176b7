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
 *            final state requested;
 *   decode:  fq_cpu_recurrent, T = 1, 16 sequences, H = 16, HV = 32, state
 *            pool of 16 slots updated in place;
 * at 1 thread and at all threads: median wall time of several runs after a
 * warm-up, reported as M token-heads/s (tokens * HV / seconds) and per thread,
 * next to llama.cpp's ggml GDN op on this machine (0.27 prefill, 0.15 decode
 * M token-heads/s per thread). Inputs as in DESIGN §3. Writes
 * <results-dir>/cpu_<YYYY-MM-DD>.json.
 */
#define _POSIX_C_SOURCE 200809L
#include "cpu/gdn_cpu.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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

int main(int argc, char **argv)
{
    const char *outdir = argc > 1 ? argv[1] : "benchmarks/results";
    const int K = 128, V = 128;
    const int all = fq_cpu_default_threads();
    int thread_counts[2] = {1, all};
    int n_tc = all > 1 ? 2 : 1;
    bench_row rows[8];
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

    double load[3] = {-1, -1, -1};
    FILE *lf = fopen("/proc/loadavg", "r");
    if (lf) {
        if (fscanf(lf, "%lf %lf %lf", &load[0], &load[1], &load[2]) != 3) load[0] = -1;
        fclose(lf);
    }
    printf("%-8s %3s %3s %5s %3s %7s %10s %14s %11s %6s %14s\n", "work", "H", "HV", "T", "N",
           "threads", "ms", "Mtok-heads/s", "per thread", "ggml", "per CPU-second");
    for (int i = 0; i < nrows; i++)
        printf("%-8s %3lld %3lld %5lld %3lld %7d %10.3f %14.3f %11.3f %6.2f %14.3f\n", rows[i].work,
               (long long)rows[i].H, (long long)rows[i].HV, (long long)rows[i].T,
               (long long)rows[i].N, rows[i].threads, rows[i].seconds * 1e3, rows[i].mth,
               rows[i].per_thread, rows[i].ggml,
               rows[i].mth * rows[i].seconds / rows[i].cpu_seconds);
    printf("load average at the end: %.2f (other processes share these cores: wall-clock\n"
           "numbers drop when it exceeds the cores; 'per CPU-second' is token-heads per\n"
           "second of CPU time actually given to this process)\n", load[0]);

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
    fprintf(f, "  \"load_average_1min\": %.2f,\n", load[0]);
    fprintf(f, "  \"rows\": [\n");
    for (int i = 0; i < nrows; i++)
        fprintf(f,
                "    {\"work\": \"%s\", \"H\": %lld, \"HV\": %lld, \"T\": %lld, \"N\": %lld, "
                "\"threads\": %d, \"seconds\": %.6g, \"mtoken_heads_per_s\": %.4f, "
                "\"per_thread\": %.4f, \"ggml_per_thread\": %.2f, \"cpu_seconds\": %.6g}%s\n",
                rows[i].work, (long long)rows[i].H, (long long)rows[i].HV, (long long)rows[i].T,
                (long long)rows[i].N, rows[i].threads, rows[i].seconds, rows[i].mth,
                rows[i].per_thread, rows[i].ggml, rows[i].cpu_seconds, i + 1 < nrows ? "," : "");
    fprintf(f, "  ]\n}\n");
    fclose(f);
    printf("wrote %s\n", path);
    return 0;
}
