/*
 * dev/cuda/check_fwd.cu — standalone check of the CUDA chunked forward
 * (fq_cuda_chunk_fwd) and recurrent step (fq_cuda_recurrent) against a
 * float64 token-by-token reference of DESIGN §1, then CUDA-event timings.
 *
 * Build and run (from the repository root):
 *
 *   gcc -std=c11 -O2 -c csrc/gdn_common.c -o /tmp/gdn_common.o && \
 *   nvcc -std=c++17 -O3 -lineinfo --use_fast_math -Icsrc \
 *        -gencode arch=compute_90a,code=sm_90a -gencode arch=compute_80,code=compute_80 \
 *        -o /tmp/check_fwd dev/cuda/check_fwd.cu csrc/cuda/gdn_cuda_fwd.cu csrc/cuda/gdn_cuda_fwd_wy.cu \
 *        csrc/cuda/gdn_cuda_fwd_state.cu csrc/cuda/gdn_cuda_fwd_output.cu csrc/cuda/gdn_cuda_recurrent.cu \
 *        /tmp/gdn_common.o && /tmp/check_fwd
 *
 * The main shapes run each stage B configuration explicitly (bvNN: state
 * columns per block, ksN: K-split; fq_cuda_fwd_state_tiled), the others the
 * forward as the library runs it (automatic configuration); the timings list
 * the stages and every stage B configuration. (The superseded first stages were removed, and with them this driver's
 * comparisons against them: git history, commit 4599409; stage A's blocked
 * kernel vs its persistent one is dev/cuda/check_fwd_wy.cu.) The last lines are a summary table.
 * Modes: `/tmp/check_fwd` (everything),
 * `quick` (no T = 32768 case, no timings), `tiny` (small problems, every
 * kernel variant, K = V = 256 included: memcheck, forced PTX JIT), `race`
 * (three, for racecheck).
 * Inputs
 * follow DESIGN §3: q, k L2-normalised (raw randn with use_qk_l2norm),
 * beta = sigmoid(randn), g = -A_h softplus(0.5 randn + 1) with A_h from 0 to
 * 16 across heads. Outputs are NaN-poisoned before every run. Exit status 1
 * if any check fails.
 */
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>
#include <algorithm>

#include "gdn.h"
#include "cuda/gdn_cuda_common.cuh"
#include "check_common.h"

static int g_fail = 0;

/* params of shape K = V = 128 (for fq_cuda_fwd_fused_available) */
static const fq_gdn_params *NULL_SHAPE_128(void)
{
    static fq_gdn_params p;
    fq_params_init(&p);
    p.K = p.V = 128;
    return &p;
}

/* ------------------------------------------------------------ random ---- */
static int g_fast_rand = 0; /* timing inputs: a cheap stand-in with unit variance */
static double randn(void)
{
    if (g_fast_rand) return (urand() + urand() + urand() - 1.5) * 2.0;
    return nrand();
}

/* value as stored in dtype dt, read back as float (what the kernel sees) */
static float round_to(float x, fq_dtype dt)
{
    if (dt == FQ_BF16) return __bfloat162float(__float2bfloat16(x));
    if (dt == FQ_F16) return __half2float(__float2half(x));
    return x;
}
static void store_as(void *dst, fq_dtype dt, size_t i, float x)
{
    if (dt == FQ_BF16) ((__nv_bfloat16 *)dst)[i] = __float2bfloat16(x);
    else if (dt == FQ_F16) ((__half *)dst)[i] = __float2half(x);
    else ((float *)dst)[i] = x;
}
static float load_as(const void *src, fq_dtype dt, size_t i)
{
    if (dt == FQ_BF16) return __bfloat162float(((const __nv_bfloat16 *)src)[i]);
    if (dt == FQ_F16) return __half2float(((const __half *)src)[i]);
    return ((const float *)src)[i];
}

/* ---------------------------------------------------------- problem ---- */
struct Problem {
    int B, T, H, HV, K, V, N;
    fq_dtype dt, gdt;
    int l2norm, has_h0, want_ht;
    std::vector<int64_t> cu; /* empty: no cu_seqlens */
    double scale;
    /* host inputs as the kernels see them (rounded to dt) */
    std::vector<float> q, k, v, g, beta, h0;
};

static void make_inputs(Problem &pb, double amax)
{
    size_t nq = (size_t)pb.B * pb.T * pb.H * pb.K, nv = (size_t)pb.B * pb.T * pb.HV * pb.V;
    size_t ng = (size_t)pb.B * pb.T * pb.HV;
    pb.q.resize(nq); pb.k.resize(nq); pb.v.resize(nv); pb.g.resize(ng); pb.beta.resize(ng);
    for (size_t r = 0; r < (size_t)pb.B * pb.T * pb.H; r++) {
        for (int which = 0; which < 2; which++) {
            float *x = (which ? pb.k.data() : pb.q.data()) + r * pb.K;
            double ss = 0;
            for (int i = 0; i < pb.K; i++) { x[i] = (float)randn(); ss += (double)x[i] * x[i]; }
            double f = pb.l2norm ? 1.0 : 1.0 / sqrt(ss);
            for (int i = 0; i < pb.K; i++) x[i] = round_to((float)(x[i] * f), pb.dt);
        }
    }
    for (size_t i = 0; i < nv; i++) pb.v[i] = round_to((float)randn(), pb.dt);
    for (size_t r = 0; r < (size_t)pb.B * pb.T; r++)
        for (int j = 0; j < pb.HV; j++) {
            double A = pb.HV > 1 ? amax * j / (pb.HV - 1) : amax;
            double z = 0.5 * randn() + 1.0;
            double sp = z > 20 ? z : log1p(exp(z));
            pb.g[r * pb.HV + j] = round_to((float)(-A * sp), pb.gdt);
            pb.beta[r * pb.HV + j] = round_to((float)(1.0 / (1.0 + exp(-randn()))), pb.gdt);
        }
    pb.N = pb.cu.empty() ? pb.B : (int)pb.cu.size() - 1;
    pb.h0.assign((size_t)pb.N * pb.HV * pb.K * pb.V, 0.f);
    if (pb.has_h0)
        for (auto &x : pb.h0) x = (float)(0.5 * randn());
    pb.scale = 1.0 / sqrt((double)pb.K);
}

/* float64 token-by-token reference of DESIGN §1 for the sequences; state
 * array [N, HV, K, V] in/out. */
static void reference(const Problem &pb, std::vector<double> &o, std::vector<double> &st)
{
    int K = pb.K, V = pb.V, HV = pb.HV, G = pb.HV / pb.H;
    o.assign((size_t)pb.B * pb.T * HV * V, 0.0);
    std::vector<double> S((size_t)K * V), q(K), k(K), sk(V), u(V);
    for (int n = 0; n < pb.N; n++) {
        int64_t bos = pb.cu.empty() ? (int64_t)n * pb.T : pb.cu[n];
        int64_t len = pb.cu.empty() ? pb.T : pb.cu[n + 1] - pb.cu[n];
        for (int j = 0; j < HV; j++) {
            int hq = j / G;
            double *Sn = &st[((size_t)n * HV + j) * K * V];
            for (size_t i = 0; i < (size_t)K * V; i++) S[i] = Sn[i];
            for (int64_t t = 0; t < len; t++) {
                int64_t row = bos + t;
                double nq = 0, nk = 0;
                for (int i = 0; i < K; i++) {
                    q[i] = pb.q[(row * pb.H + hq) * K + i];
                    k[i] = pb.k[(row * pb.H + hq) * K + i];
                    nq += q[i] * q[i]; nk += k[i] * k[i];
                }
                if (pb.l2norm) {
                    double a = 1.0 / sqrt(nq + 1e-6), b = 1.0 / sqrt(nk + 1e-6);
                    for (int i = 0; i < K; i++) { q[i] *= a; k[i] *= b; }
                }
                double alpha = exp((double)pb.g[row * HV + j]), beta = pb.beta[row * HV + j];
                for (int c = 0; c < V; c++) sk[c] = 0;
                for (int i = 0; i < K; i++)
                    for (int c = 0; c < V; c++) sk[c] += S[(size_t)i * V + c] * k[i];
                for (int c = 0; c < V; c++)
                    u[c] = beta * ((double)pb.v[(row * HV + j) * V + c] - alpha * sk[c]);
                for (int i = 0; i < K; i++)
                    for (int c = 0; c < V; c++) S[(size_t)i * V + c] = alpha * S[(size_t)i * V + c] + k[i] * u[c];
                double *orow = &o[(row * HV + j) * V];
                for (int i = 0; i < K; i++)
                    for (int c = 0; c < V; c++) orow[c] += S[(size_t)i * V + c] * q[i];
                for (int c = 0; c < V; c++) orow[c] *= pb.scale;
            }
            for (size_t i = 0; i < (size_t)K * V; i++) Sn[i] = S[i];
        }
    }
}

/* rel = |out - ref| / |ref|; any non-finite value: inf */
static double rel_err(const std::vector<float> &out, const std::vector<double> &ref)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < ref.size(); i++) {
        if (!isfinite(out[i])) return INFINITY;
        double d = out[i] - ref[i];
        num += d * d; den += ref[i] * ref[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static void report(const char *name, const char *what, double rel, double tol)
{
    int ok = rel <= tol;
    if (!ok) g_fail = 1;
    printf("  %-46s %-5s rel %.3e (tol %.0e) %s\n", name, what, rel, tol, ok ? "ok" : "FAIL");
}

/* device copies of a problem's inputs */
struct Dev {
    void *q, *k, *v, *g, *beta, *o, *cu, *ws;
    float *h0, *ht;
    size_t ws_bytes;
};

static void *upload_typed(const std::vector<float> &x, fq_dtype dt)
{
    size_t es = fq_dtype_size(dt);
    std::vector<unsigned char> h(x.size() * es + 16);
    for (size_t i = 0; i < x.size(); i++) store_as(h.data(), dt, i, x[i]);
    void *d = NULL;
    CK(cudaMalloc(&d, x.size() * es + 16));
    CK(cudaMemcpy(d, h.data(), x.size() * es, cudaMemcpyHostToDevice));
    return d;
}

static std::vector<float> download_typed(const void *d, fq_dtype dt, size_t n)
{
    size_t es = fq_dtype_size(dt);
    std::vector<unsigned char> h(n * es + 16);
    CK(cudaMemcpy(h.data(), d, n * es, cudaMemcpyDeviceToHost));
    std::vector<float> x(n);
    for (size_t i = 0; i < n; i++) x[i] = load_as(h.data(), dt, i);
    return x;
}

static void fill_params(const Problem &pb, const Dev &d, fq_gdn_params *p, int cu64)
{
    fq_params_init(p);
    p->B = pb.B; p->T = pb.T; p->H = pb.H; p->HV = pb.HV; p->K = pb.K; p->V = pb.V; p->N = pb.N;
    p->dtype = pb.dt; p->gate_dtype = pb.gdt; p->state_dtype = FQ_F32;
    p->scale = pb.scale; p->use_qk_l2norm = pb.l2norm;
    p->q = d.q; p->k = d.k; p->v = d.v; p->g = d.g; p->beta = d.beta;
    p->h0 = pb.has_h0 ? d.h0 : NULL;
    p->cu_seqlens = pb.cu.empty() ? NULL : d.cu;
    p->cu_seqlens_is_int64 = cu64;
    p->o = d.o; p->ht = pb.want_ht ? d.ht : NULL;
    p->stream = 0; p->device = 0;
    p->workspace = d.ws; p->workspace_bytes = d.ws_bytes;
}

static Dev upload(const Problem &pb, int cu64, size_t ws_bytes)
{
    Dev d;
    memset(&d, 0, sizeof d);
    d.q = upload_typed(pb.q, pb.dt); d.k = upload_typed(pb.k, pb.dt); d.v = upload_typed(pb.v, pb.dt);
    d.g = upload_typed(pb.g, pb.gdt); d.beta = upload_typed(pb.beta, pb.gdt);
    d.h0 = (float *)upload_typed(pb.h0, FQ_F32);
    size_t no = (size_t)pb.B * pb.T * pb.HV * pb.V;
    CK(cudaMalloc(&d.o, no * fq_dtype_size(pb.dt) + 16));
    CK(cudaMalloc(&d.ht, pb.h0.size() * 4 + 16));
    if (!pb.cu.empty()) {
        if (cu64) {
            CK(cudaMalloc(&d.cu, pb.cu.size() * 8));
            CK(cudaMemcpy(d.cu, pb.cu.data(), pb.cu.size() * 8, cudaMemcpyHostToDevice));
        } else {
            std::vector<int32_t> c32(pb.cu.begin(), pb.cu.end());
            CK(cudaMalloc(&d.cu, c32.size() * 4));
            CK(cudaMemcpy(d.cu, c32.data(), c32.size() * 4, cudaMemcpyHostToDevice));
        }
    }
    d.ws_bytes = ws_bytes;
    CK(cudaMalloc(&d.ws, ws_bytes > 0 ? ws_bytes : 1));
    return d;
}

/* upload() with a workspace for both forwards (the fused sm_90a one that
 * fq_cuda_chunk_fwd runs on an H200, and the three stages the [bvNN]
 * configurations call one by one), and p filled for it */
static Dev upload_chunk(const Problem &pb, int cu64, fq_gdn_params *p)
{
    Dev d0;
    memset(&d0, 0, sizeof d0);
    fill_params(pb, d0, p, cu64); /* sizes only: the workspace size */
    size_t ws = std::max(fq_cuda_chunk_fwd_workspace_bytes(p), fq_cuda_fwd_ws_layout(p, NULL, NULL));
    Dev d = upload(pb, cu64, ws);
    fill_params(pb, d, p, cu64);
    return d;
}

static void free_dev(Dev &d)
{
    cudaFree(d.q); cudaFree(d.k); cudaFree(d.v); cudaFree(d.g); cudaFree(d.beta);
    cudaFree(d.o); cudaFree(d.h0); cudaFree(d.ht); cudaFree(d.ws);
    if (d.cu) cudaFree(d.cu);
}

/* Which configuration a chunked run uses: stage B's column width and K-split
 * (0, 0: fq_cuda_chunk_fwd with its automatic choice; else the stages called
 * one by one with that bv, ks). */
struct Cfg {
    int bv, ks; /* ks: K-split (1, 2; 0 auto) */
    const char *tag;
};
static const Cfg CFG_AUTO[] = {{0, 0, "auto"}};
static const Cfg CFG_BV[] = {{0, 0, "auto"}, {16, 1, "bv16 ks1"}, {32, 1, "bv32 ks1"}, {64, 1, "bv64 ks1"},
                             {16, 2, "bv16 ks2"}, {32, 2, "bv32 ks2"}, {64, 2, "bv64 ks2"}};
/* K = V = 256 (issue 7 item 4): stage B is built with the K-split only;
 * bv16 runs its 3-deep ring when blocks <= SMs, bv32 / bv64 the 2-deep one */
static const Cfg CFG_K256[] = {{0, 0, "auto"}, {16, 2, "bv16 ks2"}, {32, 2, "bv32 ks2"}, {64, 2, "bv64 ks2"}};
#define NCFG(a) ((int)(sizeof(a) / sizeof((a)[0])))

/* summary: checks, failures, worst rel of o and ht */
struct VarStat {
    int n, fail;
    double worst;
};
static VarStat g_stat;

static fq_status run_fwd_cfg(fq_gdn_params *p, const Cfg &c)
{
    if (c.bv == 0 && c.ks == 0) return fq_cuda_chunk_fwd(p);
    /* the stages of fq_cuda_chunk_fwd, with stage B's bv forced */
    fq_fwd_ws ws;
    fq_cuda_fwd_ws_layout(p, p->workspace, &ws);
    cudaStream_t s = (cudaStream_t)p->stream;
    fq_status st;
    if ((st = fq_cuda_fwd_prepare(p, &ws, s)) != FQ_OK) return st;
    if ((st = fq_cuda_fwd_wy(p, &ws, s)) != FQ_OK) return st;
    st = fq_cuda_fwd_state_tiled(p, &ws, (float *)p->ht, c.bv, c.ks, s);
    if (st != FQ_OK) return st;
    if ((st = fq_cuda_fwd_output(p, &ws, s)) != FQ_OK) return st;
    return fq_cuda_fwd_poison(p, &ws, s);
}

static void report_cfg(const char *name, const Cfg &c, const char *what, double rel, double tol)
{
    char buf[128];
    snprintf(buf, sizeof buf, "%s [%s]", name, c.tag);
    report(buf, what, rel, tol);
    VarStat &vs = g_stat;
    vs.n++;
    if (!(rel <= tol)) vs.fail++;
    if (!(rel <= vs.worst)) vs.worst = rel; /* rel is inf for non-finite output */
}

/* one chunked-forward problem against the reference, for each config */
static void check_chunk(const char *name, Problem pb, double amax, int cu64 = 0, double tol = 5e-3,
                        const Cfg *cfgs = CFG_AUTO, int ncfg = 1)
{
    make_inputs(pb, amax);
    fq_gdn_params p;
    Dev d = upload_chunk(pb, cu64, &p);
    size_t no = (size_t)pb.B * pb.T * pb.HV * pb.V;
    std::vector<double> oref, sref(pb.h0.begin(), pb.h0.end());
    reference(pb, oref, sref);
    for (int ic = 0; ic < ncfg; ic++) {
        const Cfg &c = cfgs[ic];
        CK(cudaMemset(d.o, 0xff, no * fq_dtype_size(pb.dt))); /* NaN in every dtype */
        CK(cudaMemset(d.ht, 0xff, pb.h0.size() * 4));
        fq_status st = run_fwd_cfg(&p, c);
        CK(cudaDeviceSynchronize());
        if (st != FQ_OK) {
            printf("  %-46s FAIL status %d: %s\n", name, (int)st, fq_last_error());
            report_cfg(name, c, "run", INFINITY, tol);
            continue;
        }
        std::vector<float> o = download_typed(d.o, pb.dt, no);
        report_cfg(name, c, "o", rel_err(o, oref), tol);
        if (pb.want_ht) {
            std::vector<float> ht = download_typed(d.ht, FQ_F32, pb.h0.size());
            report_cfg(name, c, "ht", rel_err(ht, sref), tol);
        }
    }
    free_dev(d);
}

/* invalid cu_seqlens: o and ht must come back all NaN, status OK */
static void check_invalid_cu(void)
{
    Problem pb = {};
    pb.B = 1; pb.T = 100; pb.H = 2; pb.HV = 2; pb.K = 64; pb.V = 64;
    pb.dt = FQ_BF16; pb.gdt = FQ_F32; pb.has_h0 = 1; pb.want_ht = 1;
    pb.cu = {0, 40, 20, 100};
    make_inputs(pb, 1.0);
    fq_gdn_params p;
    Dev d = upload_chunk(pb, 0, &p);
    size_t no = (size_t)pb.T * pb.HV * pb.V;
    CK(cudaMemset(d.o, 0, no * 2));
    CK(cudaMemset(d.ht, 0, pb.h0.size() * 4));
    fq_status st = fq_cuda_chunk_fwd(&p);
    CK(cudaDeviceSynchronize());
    std::vector<float> o = download_typed(d.o, pb.dt, no), ht = download_typed(d.ht, FQ_F32, pb.h0.size());
    size_t nn = 0;
    for (float x : o) nn += isnan(x) ? 1 : 0;
    for (float x : ht) nn += isnan(x) ? 1 : 0;
    int ok = st == FQ_OK && nn == o.size() + ht.size();
    if (!ok) g_fail = 1;
    printf("  %-46s NaN %zu of %zu %s\n", "chunk_fwd invalid cu_seqlens -> NaN", nn, o.size() + ht.size(),
           ok ? "ok" : "FAIL");
    /* recurrent with the same invalid offsets */
    std::vector<float> pool((size_t)3 * pb.HV * pb.K * pb.V, 1.0f);
    float *dpool = (float *)upload_typed(pool, FQ_F32);
    fq_params_init(&p);
    fill_params(pb, d, &p, 0);
    p.ht = NULL; p.h0 = NULL; p.state = dpool; p.P = 3;
    p.workspace_bytes = fq_cuda_recurrent_workspace_bytes(&p);
    CK(cudaMemset(d.o, 0, no * 2));
    st = fq_cuda_recurrent(&p);
    CK(cudaDeviceSynchronize());
    o = download_typed(d.o, pb.dt, no);
    std::vector<float> pool2 = download_typed(dpool, FQ_F32, pool.size());
    nn = 0;
    for (float x : o) nn += isnan(x) ? 1 : 0;
    ok = st == FQ_OK && nn == o.size() && pool2 == pool;
    if (!ok) g_fail = 1;
    printf("  %-46s NaN %zu of %zu, pool untouched %d %s\n", "recurrent invalid cu_seqlens -> NaN", nn,
           o.size(), (int)(pool2 == pool), ok ? "ok" : "FAIL");
    cudaFree(dpool);
    free_dev(d);
}

/* error statuses */
static void check_errors(void)
{
    fq_gdn_params p;
    fq_params_init(&p);
    p.B = 1; p.T = 10; p.H = 1; p.HV = 1; p.K = 96; p.V = 96; p.N = 1;
    p.dtype = FQ_BF16;
    /* distinct fake addresses: the aliasing check must not be what refuses */
    p.q = (void *)0x100000; p.k = (void *)0x200000; p.v = (void *)0x300000; p.g = (void *)0x400000;
    p.beta = (void *)0x500000; p.o = (void *)0x600000;
    fq_status st = fq_cuda_chunk_fwd(&p);
    int ok1 = st == FQ_ERR_VALUE && strstr(fq_last_error(), "K in {64, 128}");
    printf("  %-46s %d \"%s\" %s\n", "K=96 rejected", (int)st, fq_last_error(), ok1 ? "ok" : "FAIL");
    p.K = p.V = 64; p.dtype = FQ_F64; p.state_dtype = FQ_F64;
    st = fq_cuda_chunk_fwd(&p);
    int ok2 = st == FQ_ERR_TYPE;
    printf("  %-46s %d \"%s\" %s\n", "float64 rejected", (int)st, fq_last_error(), ok2 ? "ok" : "FAIL");
    p.dtype = FQ_BF16; p.state_dtype = FQ_F32; p.workspace = NULL;
    st = fq_cuda_chunk_fwd(&p);
    int ok3 = st == FQ_ERR_VALUE && strstr(fq_last_error(), "workspace");
    printf("  %-46s %d \"%s\" %s\n", "missing workspace rejected", (int)st, fq_last_error(), ok3 ? "ok" : "FAIL");
    /* K = V = 256 (issue 7 item 4): the chunked forward takes it (the
     * three-stage forward, never the fused one); 256 with another head dim
     * is refused, naming the argument (the backward's refusal of K = 256 is
     * tests/test_gpu.py's: this driver does not link the backward) */
    p.K = 256; p.V = 128; p.workspace = (void *)0x700000; p.workspace_bytes = (size_t)1 << 40;
    st = fq_cuda_chunk_fwd(&p);
    int ok4 = st == FQ_ERR_VALUE && strncmp(fq_last_error(), "v:", 2) == 0 && strstr(fq_last_error(), "K = V = 256");
    printf("  %-46s %d \"%s\" %s\n", "K=256 V=128 rejected", (int)st, fq_last_error(), ok4 ? "ok" : "FAIL");
    p.V = 256;
    int ok5 = !fq_cuda_fwd_fused_available(&p);
    printf("  %-46s %s\n", "K=V=256: no fused forward (three stages)", ok5 ? "ok" : "FAIL");
    if (!(ok1 && ok2 && ok3 && ok4 && ok5)) g_fail = 1;
}

/* recurrent step: pool [P, HV, K, V], indices with -1 (padding); compares o
 * and the pool with the reference; untouched slots bitwise; padding o = 0.
 * Also compares with the chunked forward on the same tokens. */
/* dup: the last sequence (with tokens) also names sequence 0's slot (a duplicate state index: its
 * o rows NaN, nothing written, the slot sequence 0's; the reference treats it as padding, then its
 * o rows are checked to be NaN) */
static void check_recurrent(const char *name, int N, int T, int H, int HV, int K, int V, int use_cu,
                            int l2norm, fq_dtype dt, int idx64, int vk = 0, int dup = 0)
{
    Problem pb = {};
    pb.H = H; pb.HV = HV; pb.K = K; pb.V = V; pb.dt = dt; pb.gdt = FQ_F32;
    pb.l2norm = l2norm; pb.has_h0 = 1; pb.want_ht = 1;
    if (use_cu) {
        pb.B = 1;
        pb.cu.push_back(0);
        for (int n = 0; n < N; n++) pb.cu.push_back(pb.cu.back() + (n * 2) % (T + 1)); /* 0,2,4,1,.. */
        pb.T = (int)pb.cu.back();
    } else {
        pb.B = N; pb.T = T;
    }
    make_inputs(pb, 8.0);
    int P = N + 3;
    std::vector<int64_t> idx(N);
    for (int n = 0; n < N; n++) idx[n] = (n % 3 == 1) ? -1 : (P - 1 - n); /* reversed, some padding */
    std::vector<int64_t> idx_dev(idx);
    int ndup = dup && N >= 3 ? N - 1 : -1;
    while (ndup > 1 && use_cu && pb.cu[ndup + 1] == pb.cu[ndup]) ndup--; /* (one with tokens) */
    if (ndup >= 0) { idx[ndup] = -1; idx_dev[ndup] = idx_dev[0]; }
    size_t SS = (size_t)HV * K * V;
    std::vector<float> pool((size_t)P * SS);
    for (auto &x : pool) x = (float)(0.5 * randn());
    /* reference: sequences with a slot start from pool[slot] */
    for (int n = 0; n < N; n++)
        if (idx[n] >= 0) std::copy(pool.begin() + idx[n] * SS, pool.begin() + (idx[n] + 1) * SS, pb.h0.begin() + n * SS);
    std::vector<double> oref, sref(pb.h0.begin(), pb.h0.end());
    reference(pb, oref, sref);
    std::vector<double> poolref(pool.begin(), pool.end());
    for (int n = 0; n < N; n++) {
        if (idx[n] >= 0) std::copy(sref.begin() + n * SS, sref.begin() + (n + 1) * SS, poolref.begin() + idx[n] * SS);
        else { /* padding: o rows 0 */
            int64_t bos = use_cu ? pb.cu[n] : (int64_t)n * pb.T, len = use_cu ? pb.cu[n + 1] - pb.cu[n] : pb.T;
            for (int64_t r = bos; r < bos + len; r++)
                for (size_t c = 0; c < (size_t)HV * V; c++) oref[r * HV * V + c] = 0;
        }
    }
    fq_gdn_params p;
    Dev d0;
    memset(&d0, 0, sizeof d0);
    fill_params(pb, d0, &p, 1);
    Dev d = upload(pb, 1, 256);
    fill_params(pb, d, &p, 1);
    /* vk: the pool stored [P, HV, V, K] (state_layout "vk"), compared in [K, V] after the download */
    auto transpose_heads = [&](const std::vector<float> &x, int to_vk) {
        std::vector<float> y(x.size());
        for (size_t h = 0; h < x.size() / ((size_t)K * V); h++)
            for (int kk = 0; kk < K; kk++)
                for (int vv = 0; vv < V; vv++) {
                    const size_t a = h * K * V + (size_t)kk * V + vv, b = h * K * V + (size_t)vv * K + kk;
                    if (to_vk) y[b] = x[a]; else y[a] = x[b];
                }
        return y;
    };
    float *dpool = (float *)upload_typed(vk ? transpose_heads(pool, 1) : pool, FQ_F32);
    void *didx = NULL;
    if (idx64) {
        CK(cudaMalloc(&didx, N * 8));
        CK(cudaMemcpy(didx, idx_dev.data(), N * 8, cudaMemcpyHostToDevice));
    } else {
        std::vector<int32_t> i32(idx_dev.begin(), idx_dev.end());
        CK(cudaMalloc(&didx, N * 4));
        CK(cudaMemcpy(didx, i32.data(), N * 4, cudaMemcpyHostToDevice));
    }
    p.h0 = NULL; p.ht = NULL; p.state = dpool; p.P = P;
    p.state_indices = didx; p.state_indices_is_int64 = idx64;
    p.state_vk = vk;
    size_t no = (size_t)pb.B * pb.T * HV * V;
    CK(cudaMemset(d.o, 0xff, no * fq_dtype_size(dt)));
    fq_status st = fq_cuda_recurrent(&p);
    CK(cudaDeviceSynchronize());
    if (st != FQ_OK) {
        printf("  %-46s FAIL status %d: %s\n", name, (int)st, fq_last_error());
        g_fail = 1;
    } else {
        std::vector<float> o = download_typed(d.o, dt, no);
        std::vector<float> pool2 = download_typed(dpool, FQ_F32, pool.size());
        if (vk) pool2 = transpose_heads(pool2, 0);
        if (ndup >= 0) { /* the duplicate's o rows: NaN, then out of the comparison (its reference rows are 0) */
            const int64_t bos = use_cu ? pb.cu[ndup] : (int64_t)ndup * pb.T;
            const int64_t len = use_cu ? pb.cu[ndup + 1] - pb.cu[ndup] : pb.T;
            size_t notnan = 0;
            for (int64_t r = bos; r < bos + len; r++)
                for (size_t c = 0; c < (size_t)HV * V; c++) {
                    notnan += !isnan(o[r * HV * V + c]);
                    o[r * HV * V + c] = 0.f;
                }
            printf("  %-46s duplicate's o not NaN %zu %s\n", name, notnan, notnan ? "FAIL" : "ok");
            if (notnan) g_fail = 1;
        }
        report(name, "o", rel_err(o, oref), 5e-3);
        report(name, "pool", rel_err(pool2, poolref), 5e-3);
        size_t untouched_bad = 0, pad_bad = 0;
        for (int s = 0; s < P; s++) {
            bool used = false;
            for (int n = 0; n < N; n++) used |= idx[n] == s;
            if (!used)
                for (size_t i = 0; i < SS; i++) untouched_bad += pool2[s * SS + i] != pool[s * SS + i];
        }
        for (size_t i = 0; i < no; i++) pad_bad += (oref[i] == 0.0 && o[i] != 0.0f);
        int ok = untouched_bad == 0 && pad_bad == 0;
        if (!ok) g_fail = 1;
        printf("  %-46s unused slots changed %zu, padding o != 0 %zu %s\n", name, untouched_bad, pad_bad,
               ok ? "ok" : "FAIL");
        /* recurrent == chunked on the same tokens (sequences with a slot) */
        if (!use_cu && !vk) {
            fill_params(pb, d, &p, 1);
            p.workspace_bytes = fq_cuda_chunk_fwd_workspace_bytes(&p);
            void *ws2 = NULL;
            CK(cudaMalloc(&ws2, p.workspace_bytes));
            p.workspace = ws2;
            void *o2 = NULL;
            CK(cudaMalloc(&o2, no * fq_dtype_size(dt)));
            CK(cudaMemset(o2, 0xff, no * fq_dtype_size(dt)));
            p.o = o2;
            st = fq_cuda_chunk_fwd(&p);
            CK(cudaDeviceSynchronize());
            std::vector<float> oc = download_typed(o2, dt, no);
            std::vector<double> orc(no);
            std::vector<float> orr(no);
            for (size_t i = 0; i < no; i++) orc[i] = oc[i];
            /* compare on sequences that had a slot */
            double num = 0, den = 0;
            for (int n = 0; n < N; n++) {
                if (idx[n] < 0) continue;
                for (size_t i = (size_t)n * T * HV * V; i < (size_t)(n + 1) * T * HV * V; i++) {
                    double dd = (double)o[i] - orc[i];
                    num += dd * dd; den += orc[i] * orc[i];
                    if (!isfinite(oc[i])) num = INFINITY;
                }
            }
            report(name, "o==chunk", st == FQ_OK ? sqrt(num / den) : INFINITY, 5e-3);
            cudaFree(ws2); cudaFree(o2);
        }
    }
    cudaFree(dpool); cudaFree(didx);
    free_dev(d);
}

/* ------------------------------------------------------------ timing ---- */
static float median(std::vector<float> x)
{
    std::sort(x.begin(), x.end());
    return x[x.size() / 2];
}

typedef void (*timed_fn)(fq_gdn_params *p, const fq_fwd_ws *ws, int what);
static int g_graph_calls = 1; /* calls captured per graph (time_it returns the time per call) */
static std::vector<float *> g_rec_pools; /* time_recurrent: pools taken in turn by the timed calls */
static size_t g_rec_next = 0;

/* CUDA-graph replays of fn (captured once on a fresh stream), timed with
 * events: median of 20 after warm-up. Also proves the call is capturable. */
static float time_it(fq_gdn_params *p, const fq_fwd_ws *ws, int what, timed_fn fn)
{
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    p->stream = (void *)s;
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
    for (int i = 0; i < 3; i++) fn(p, ws, what);
    CK(cudaStreamSynchronize(s));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < g_graph_calls; i++) fn(p, ws, what);
    CK(cudaStreamEndCapture(s, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < 3; i++) CK(cudaGraphLaunch(exec, s));
    CK(cudaStreamSynchronize(s));
    std::vector<float> ms;
    for (int i = 0; i < 20; i++) {
        CK(cudaEventRecord(a, s));
        CK(cudaGraphLaunch(exec, s));
        CK(cudaEventRecord(b, s));
        CK(cudaEventSynchronize(b));
        float t = 0;
        CK(cudaEventElapsedTime(&t, a, b));
        ms.push_back(t / g_graph_calls);
    }
    CK(cudaGraphExecDestroy(exec)); CK(cudaGraphDestroy(graph));
    CK(cudaEventDestroy(a)); CK(cudaEventDestroy(b));
    p->stream = NULL;
    CK(cudaStreamDestroy(s));
    return median(ms);
}

#ifdef FQ_FUSED_TIMELINE
extern "C" int fq_cuda_fused_timeline(unsigned long long *host, int n);
#endif
static int g_time_bv = 0, g_time_ks = 0; /* stage B column width, K-split for the timed runs */

static void run_stage(fq_gdn_params *p, const fq_fwd_ws *ws, int what)
{
    fq_status st = FQ_OK;
    cudaStream_t s = (cudaStream_t)p->stream;
    switch (what) {
    case 1: st = fq_cuda_chunk_fwd(p); break;
    case 2: st = fq_cuda_fwd_prepare(p, ws, s); break;
    case 4: st = fq_cuda_fwd_wy(p, ws, s); break;
    case 6: st = fq_cuda_fwd_state_tiled(p, ws, (float *)p->ht, g_time_bv, g_time_ks, s); break;
    case 8: /* (time_recurrent's pools in turn, one per captured call, when it set them) */
        if (!g_rec_pools.empty()) p->state = g_rec_pools[g_rec_next++ % g_rec_pools.size()];
        st = fq_cuda_recurrent(p);
        break;
    case 9: st = fq_cuda_fwd_output(p, ws, s); break;
    case 10: st = fq_cuda_fwd_inverse(p, ws, 0, s); break; /* (alone: the total runs it beside the state pass where it can) */
    case 11:
        if ((st = fq_cuda_fwd_segments(p, ws, 0, s)) == FQ_OK) st = fq_cuda_fwd_fused(p, ws, 0, s);
        break;
    case 12: /* the three-stage forward, as on GPUs without the fused kernel */
        if ((st = fq_cuda_fwd_prepare(p, ws, s)) == FQ_OK && (st = fq_cuda_fwd_wy(p, ws, s)) == FQ_OK &&
            (st = fq_cuda_fwd_state(p, ws, (float *)p->ht, 0, s)) == FQ_OK)
            st = fq_cuda_fwd_output(p, ws, s);
        break;
    }
    if (st != FQ_OK) { fprintf(stderr, "timed call failed: %s\n", fq_last_error()); exit(2); }
}

/* one row of the final table */
struct TimeRow {
    char shape[48];
    double fla, fqla, tot, prep, a, b[7], c; /* b: ks1 bv16/32/64, ks2 bv16/32/64, auto */
    double old, inv, fused;            /* three-stage total; fused forward's stage A and main kernel */
};
static std::vector<TimeRow> g_rows;

/* H/HV, nseq sequences of len tokens (varlen: one row, cu_seqlens); K = V = kd
 * (256: the three-stage forward, stage B's K-split configurations only) */
static void time_fwd(int H, int HV, int nseq, int len, int varlen, double fla_ms, double fqla_ms, int kd = 128)
{
    Problem pb = {};
    pb.B = varlen ? 1 : nseq; pb.T = varlen ? nseq * len : len; pb.H = H; pb.HV = HV; pb.K = kd; pb.V = kd;
    pb.dt = FQ_BF16; pb.gdt = FQ_F32; pb.has_h0 = 1; pb.want_ht = 1;
    if (varlen)
        for (int i = 0; i <= nseq; i++) pb.cu.push_back((int64_t)i * len);
    make_inputs(pb, 4.0);
    fq_gdn_params p;
    Dev d = upload_chunk(pb, 0, &p);
    fq_fwd_ws ws;
    fq_cuda_fwd_ws_layout(&p, d.ws, &ws);
    TimeRow r;
    memset(&r, 0, sizeof r);
    snprintf(r.shape, sizeof r.shape, "%s%d/%d %s%dx%d", kd != 128 ? (kd == 256 ? "K256 " : "K64 ") : "", H, HV,
             varlen ? "varlen " : "", nseq, len);
    r.fla = fla_ms;
    r.fqla = fqla_ms;
    r.tot = time_it(&p, &ws, 1, run_stage);
    r.prep = time_it(&p, &ws, 2, run_stage);
    r.a = time_it(&p, &ws, 4, run_stage);
    const int cfg2[7][2] = {{16, 1}, {32, 1}, {64, 1}, {16, 2}, {32, 2}, {64, 2}, {0, 0}};
    for (int i = 0; i < 7; i++) {
        g_time_bv = cfg2[i][0]; g_time_ks = cfg2[i][1];
        if (kd == 256 && g_time_ks == 1) { r.b[i] = NAN; continue; } /* not built at K = 256 */
        r.b[i] = time_it(&p, &ws, 6, run_stage);
    }
    g_time_bv = g_time_ks = 0;
    r.c = time_it(&p, &ws, 9, run_stage);
    r.old = time_it(&p, &ws, 12, run_stage);
    if (fq_cuda_fwd_fused_available(&p)) {
        fq_fwd_ws wsf;
        fq_cuda_fwd_fused_ws_layout(&p, d.ws, &wsf);
        r.inv = time_it(&p, &wsf, 10, run_stage);
        r.fused = time_it(&p, &wsf, 11, run_stage);
    }
    /* 183 kFLOP per token and value head at K = V = 128 (DESIGN §6; not
     * counted for other head dims: nan) */
    double tflops = kd == 128 ? 183e3 * (double)nseq * len * HV / (r.tot * 1e-3) / 1e12 : NAN;
    printf("  fwd %-22s total %.3f ms (%.1f TFLOP/s) | fused: inverse %.3f, main %.3f | three-stage %.3f: "
           "prepare %.3f | A %.3f | B ks1 bv16 %.3f bv32 %.3f bv64 %.3f, ks2 bv16 %.3f bv32 %.3f bv64 %.3f, "
           "auto %.3f | C %.3f\n",
           r.shape, r.tot, tflops, r.inv, r.fused, r.old, r.prep, r.a, r.b[0], r.b[1], r.b[2], r.b[3], r.b[4],
           r.b[5], r.b[6], r.c);
    fflush(stdout);
    g_rows.push_back(r);
    free_dev(d);
}

/* idx: the pool through state_indices = arange(N) (int32), as bench_gpu.py's decode rows; 0:
 * slot n for sequence n (its no-index rows) */
static void time_recurrent(int N, int H, int HV, int T, int idx, int vk = 0)
{
    Problem pb = {};
    pb.B = N; pb.T = T; pb.H = H; pb.HV = HV; pb.K = 128; pb.V = 128;
    pb.dt = FQ_BF16; pb.gdt = FQ_F32; pb.has_h0 = 0; pb.want_ht = 0;
    make_inputs(pb, 4.0);
    fq_gdn_params p;
    Dev d = upload(pb, 0, 256);
    fill_params(pb, d, &p, 0);
    std::vector<float> pool((size_t)N * HV * 128 * 128);
    for (auto &x : pool) x = (float)(0.1 * randn());
    /* as bench_gpu.py's decode rows: several pools taken in turn by the captured steps, so that
     * a row's pools are not all in the 50 MB L2 (at least 128 MB in all, at most 8 pools), except
     * N = 1's 100 steps on one 2 MB pool (the bench rotates 8: L2-resident either way) */
    const size_t pool_bytes = pool.size() * 4;
    int npools = N == 1 ? 1 : (int)((128u << 20) / pool_bytes);
    npools = npools < 1 ? 1 : (npools > 8 ? 8 : npools);
    for (int i = 0; i < npools; i++) g_rec_pools.push_back((float *)upload_typed(pool, FQ_F32));
    g_rec_next = 0;
    p.state = g_rec_pools[0]; p.P = N; p.h0 = NULL; p.ht = NULL;
    int *didx = NULL;
    if (idx) {
        std::vector<int> ar(N);
        for (int i = 0; i < N; i++) ar[i] = i;
        CK(cudaMalloc(&didx, sizeof(int) * N));
        CK(cudaMemcpy(didx, ar.data(), sizeof(int) * N, cudaMemcpyHostToDevice));
        p.state_indices = didx; p.state_indices_is_int64 = 0;
    }
    p.state_vk = vk; /* (the timing does not depend on the values: the same pool read as [V, K]) */
    /* N = 1: 100 steps per graph, as bench_gpu.py's decode rows (one step per graph measures the
     * graph's launch) */
    g_graph_calls = N == 1 ? 100 : npools;
    float t = time_it(&p, NULL, 8, run_stage);
    g_graph_calls = 1;
    double floor_ms = 2.0 * pool.size() * 4 / 4.27e12 * 1e3;
    printf("  recurrent N=%d H=%d HV=%d T=%d%s%s%s: %.4f ms (floor %.4f ms)\n", N, H, HV, T, idx ? " idx" : "",
           vk ? " vk" : "", N == 1 ? " x100" : (npools > 1 ? " (pools in turn)" : ""), t, floor_ms);
    if (didx) cudaFree(didx);
    for (float *x : g_rec_pools) cudaFree(x);
    g_rec_pools.clear();
    free_dev(d);
}

/* stage A of the fused forward (fq_cuda_fwd_inverse: A = (I+L)^-1 by
 * bf16 block products, and the gate record) against stage A of the
 * three-stage forward (fq_cuda_fwd_wy_blocked with ws->a set: fp32 blocks) */
static void check_inverse(int K, int l2norm)
{
    Problem pb = {};
    pb.B = 1; pb.T = 1193; pb.H = 4; pb.HV = 8; pb.K = K; pb.V = K;
    pb.cu = {0, 1, 64, 128, 193, 193, 1193};
    pb.dt = FQ_BF16; pb.gdt = FQ_F32; pb.has_h0 = 1; pb.want_ht = 1; pb.l2norm = l2norm;
    make_inputs(pb, 16.0);
    fq_gdn_params p;
    Dev d = upload_chunk(pb, 0, &p);
    fq_fwd_ws wo, wf;
    fq_cuda_fwd_ws_layout(&p, d.ws, &wo);
    const size_t nit = (size_t)wo.nc_max * pb.HV, na = nit * 64 * 64;
    fq_bf16 *a_old = NULL;
    CK(cudaMalloc(&a_old, na * 2));
    CK(cudaMemset(a_old, 0xff, na * 2));
    wo.a = a_old;
    fq_status st = fq_cuda_fwd_prepare(&p, &wo, 0);
    if (st == FQ_OK) st = fq_cuda_fwd_wy_blocked(&p, &wo, 0);
    CK(cudaDeviceSynchronize());
    std::vector<float> A0 = download_typed(a_old, FQ_BF16, na), G0 = download_typed(wo.gamma, FQ_F32, nit * 64);
    std::vector<fq_chunk_info> ch(wo.nc_max);
    CK(cudaMemcpy(ch.data(), wo.chunks, ch.size() * sizeof(fq_chunk_info), cudaMemcpyDeviceToHost));
    fq_cuda_fwd_fused_ws_layout(&p, d.ws, &wf);
    CK(cudaMemset(wf.a, 0xff, nit * FQ_APACK_BYTES));
    if (st == FQ_OK) st = fq_cuda_fwd_prepare(&p, &wf, 0);
    if (st == FQ_OK) st = fq_cuda_fwd_inverse(&p, &wf, 0, 0);
    CK(cudaDeviceSynchronize());
    char name[96];
    snprintf(name, sizeof name, "stage A inverse vs blocked, K=%d%s, varlen", K, l2norm ? " l2norm" : "");
    if (st != FQ_OK) {
        printf("  %-46s FAIL status %d: %s\n", name, (int)st, fq_last_error());
        g_fail = 1;
    } else {
        std::vector<float> A1 = download_typed(wf.a, FQ_BF16, nit * FQ_APACK_ELEMS), R1 = download_typed(wf.rec, FQ_F32, nit * FQ_REC_FLOATS);
        double num = 0, den = 0, gmax = 0, amax = 0;
        for (size_t it = 0; it < nit; it++) {
            if (ch[it / pb.HV].seq < 0) continue;
            for (int e = 0; e < 64 * 64; e++) {
                /* the fused forward's stage A stores A'' = A diag(beta) (beta: record .y),
                 * packed (fq_apack_index; the blocks above the diagonal are not stored: 0) */
                const int pi = fq_apack_index(e / 64, e % 64);
                double x = pi < 0 ? 0.0 : A1[it * FQ_APACK_ELEMS + pi], y = A0[it * 4096 + e] * R1[it * FQ_REC_FLOATS + FQ_REC_BETA + e % 64];
                if (!isfinite(x)) num = INFINITY;
                num += (x - y) * (x - y); den += y * y;
                amax = std::max(amax, fabs(x - y));
            }
            for (int r = 0; r < 64; r++)
                gmax = std::max(gmax, fabs(R1[it * FQ_REC_FLOATS + FQ_REC_G2 + r] / 1.4426950408889634 - G0[it * 64 + r]));
        }
        report(name, "A''", sqrt(num / den), 1e-2);
        printf("  %-46s max |dA| %.3e, max |dgamma| %.3e\n", "", amax, gmax);
        if (!(gmax < 1e-3)) { g_fail = 1; printf("  gamma differs: FAIL\n"); }
    }
    cudaFree(a_old);
    free_dev(d);
}

/* Batch invariance of the fused forward (with its context parallelism): a
 * sequence's o rows and final state are bit for bit the same alone and
 * packed after another sequence (its split depends only on its own length). */
static void check_batch_invariance(int HV, int lenA, int lenB)
{
    Problem ab = {};
    ab.B = 1; ab.H = 1; ab.HV = HV; ab.K = 128; ab.V = 128; ab.T = lenB + lenA;
    ab.dt = FQ_BF16; ab.gdt = FQ_F32; ab.has_h0 = 1; ab.want_ht = 1;
    ab.cu = {0, lenB, lenB + lenA};
    make_inputs(ab, 16.0);
    Problem a = ab;
    a.T = lenA; a.cu.clear(); a.N = 1;
    const size_t qk = (size_t)ab.H * ab.K, vv = (size_t)ab.HV * ab.V, gg = ab.HV, SS = (size_t)ab.HV * ab.K * ab.V;
    a.q.assign(ab.q.begin() + lenB * qk, ab.q.end());
    a.k.assign(ab.k.begin() + lenB * qk, ab.k.end());
    a.v.assign(ab.v.begin() + lenB * vv, ab.v.end());
    a.g.assign(ab.g.begin() + lenB * gg, ab.g.end());
    a.beta.assign(ab.beta.begin() + lenB * gg, ab.beta.end());
    a.h0.assign(ab.h0.begin() + SS, ab.h0.end());
    std::vector<unsigned short> oa, oab;
    std::vector<float> ha, hab;
    for (int which = 0; which < 2; which++) {
        Problem &pb = which ? ab : a;
        fq_gdn_params p;
        Dev d = upload_chunk(pb, 0, &p);
        size_t no = (size_t)pb.T * vv;
        CK(cudaMemset(d.o, 0xff, no * 2));
        CK(cudaMemset(d.ht, 0xff, pb.h0.size() * 4));
        fq_status st = fq_cuda_chunk_fwd(&p);
        CK(cudaDeviceSynchronize());
        if (st != FQ_OK) { printf("  batch invariance: %s FAIL\n", fq_last_error()); g_fail = 1; free_dev(d); return; }
        std::vector<unsigned short> o(no);
        std::vector<float> h(pb.h0.size());
        CK(cudaMemcpy(o.data(), d.o, no * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(h.data(), d.ht, h.size() * 4, cudaMemcpyDeviceToHost));
        if (which) { oab = o; hab = h; } else { oa = o; ha = h; }
        free_dev(d);
    }
    size_t bad = 0;
    for (size_t i = 0; i < oa.size(); i++) bad += oa[i] != oab[lenB * vv + i];
    for (size_t i = 0; i < ha.size(); i++) bad += memcmp(&ha[i], &hab[SS + i], 4) != 0;
    int ok = bad == 0;
    if (!ok) g_fail = 1;
    printf("  %-46s %zu bits differ %s\n", "batch invariance (o, ht of a packed sequence)", bad, ok ? "ok" : "FAIL");
    g_stat.n++;
    if (!ok) g_stat.fail++;
}

/* the chunked-forward correctness suite; cfgs: which variants */
static void chunk_suite(int quick, int tiny, int race)
{
    Problem b = {};
    b.B = 2; b.T = 200; b.H = 4; b.HV = 8; b.K = 128; b.V = 128;
    b.dt = FQ_BF16; b.gdt = FQ_F32; b.has_h0 = 1; b.want_ht = 1;
    if (race) {
        /* racecheck: every stage-B variant, both ring depths, short chains */
        Problem x = b; x.B = 4; x.HV = 16; x.T = 130;
        check_chunk("T=130 B=4 H=4 HV=16", x, 16.0, 0, 5e-3, CFG_BV, NCFG(CFG_BV));
        x.K = 64; x.V = 64; x.B = 1; x.T = 100;
        check_chunk("  K=V=64 T=100", x, 16.0, 0, 5e-3, CFG_BV, NCFG(CFG_BV));
        x.K = 256; x.V = 256; x.HV = 2; x.H = 1;
        check_chunk("  K=V=256 T=100 HV=2", x, 16.0, 0, 5e-3, CFG_K256, NCFG(CFG_K256));
        x = b; x.B = 1; x.H = 16; x.HV = 32; x.T = 200; /* stage A beside the state pass */
        check_chunk("  beside T=200 H=16 HV=32", x, 16.0);
        x.B = 3; x.T = 130; /* PAIR: 192 FULL CTAs would need two waves */
        check_chunk("  pair T=130 B=3 H=16 HV=32", x, 16.0);
        return;
    }
    {
        /* a ladder of small problems: each adds one part of the fused kernel
         * (one chunk without state: P and U; with h0: W S and Q S; two
         * chunks: the state update; a short last chunk: the padding rows) */
        Problem x = b; x.B = 1; x.H = 1; x.HV = 1;
        x.T = 64; x.has_h0 = 0; check_chunk("ladder T=64 no h0", x, 4.0);
        x.has_h0 = 1; check_chunk("ladder T=64 h0", x, 4.0);
        x.T = 128; x.has_h0 = 0; check_chunk("ladder T=128 no h0", x, 4.0);
        x.T = 100; x.has_h0 = 1; check_chunk("ladder T=100 h0", x, 4.0);
        x.T = 200; x.HV = 2; x.V = 64; check_chunk("ladder T=200 V=64", x, 4.0);
        x.K = 64; check_chunk("ladder T=200 K=V=64", x, 4.0);
    }
    {
        /* context parallelism of the fused forward (H=1, HV=2: up to 16
         * segments of >= 8 chunks, none below three, and only as many as
         * their maps fit in the sequence's rows of o: fq_omap): one sequence
         * in 3 segments; varlen with 4, 3 and 1 segments; fp32 o (4
         * segments), K = 64 / V = 128 (4), K = V = 64 (4); bits independent of
         * the batch */
        Problem x = b; x.B = 1; x.H = 1; x.HV = 2;
        x.T = 2048; check_chunk("cp T=2048 HV=2 (3 segments)", x, 16.0);
        x.T = 2048; check_chunk("cp T=2048 HV=2 a_max 0 (no decay)", x, 0.0);
        x.cu = {0, 2800, 4900, 5000}; x.T = 5000; check_chunk("cp varlen 2800,2100,100", x, 16.0);
        x.cu.clear(); x.T = 2048; x.dt = FQ_F32; check_chunk("cp T=2048 HV=2 fp32", x, 16.0);
        x.dt = FQ_BF16; x.K = 64; check_chunk("cp T=2048 HV=2 K=64 V=128", x, 16.0);
        x.V = 64; check_chunk("cp T=2048 HV=2 K=V=64", x, 16.0);
        check_batch_invariance(2, 2100, 1000);
    }
    {
        /* stage A beside the state pass (fq_cuda_fwd_beside: one sequence with
         * no segments, HV (K + V) / 64 > 80, and at most half the SMs of
         * state-pass CTAs): against the reference, and the bits of the normal
         * order (the sequence after another: twice the CTAs, one kernel after
         * the other) */
        Problem x = b; x.B = 1; x.H = 16; x.HV = 32; x.T = 1000;
        check_chunk("beside T=1000 H=16 HV=32 h0", x, 16.0);
        x.K = 64; x.V = 64; x.H = 24; x.HV = 48; x.T = 333; x.l2norm = 1;
        check_chunk("beside K=V=64 H=24 HV=48 T=333 l2norm", x, 16.0);
        check_batch_invariance(32, 1000, 300);
    }
    {
        /* PAIR (fq_fwd_pair: both column blocks of a value head in one CTA, where
         * FULL's CTAs would need more than one wave): bf16 and fp32, K = 64,
         * varlen with short and empty sequences, the L2 norm; and the bits of a
         * sequence alone (128 FULL CTAs at HV = 64) and packed after another one
         * (PAIR) */
        Problem x = b; x.B = 3; x.H = 16; x.HV = 32; x.T = 200;
        check_chunk("pair B=3 T=200 H=16 HV=32 h0", x, 16.0);
        x.dt = FQ_F32; check_chunk("pair fp32", x, 16.0);
        x.dt = FQ_BF16; x.K = 64; check_chunk("pair K=64 V=128", x, 16.0);
        x.K = 128; x.B = 1; x.cu = {0, 1, 64, 128, 193, 193, 1193}; x.T = 1193; x.l2norm = 1; x.has_h0 = 0;
        check_chunk("pair varlen 1,63,64,65,0,1000 l2norm, no h0", x, 16.0);
        check_batch_invariance(64, 1000, 300);
    }
    check_chunk("T=200 B=2 H=4 HV=8 K=V=128 bf16 h0", b, 16.0, 0, 5e-3, CFG_BV, NCFG(CFG_BV));
    {
        /* enough blocks for the 2-deep ring (blocks > SMs) at bv16/32 */
        Problem x = b; x.B = 4; x.HV = 16;
        check_chunk("T=200 B=4 H=4 HV=16", x, 16.0, 0, 5e-3, CFG_BV, NCFG(CFG_BV));
    }
    {
        Problem x = b; x.B = 1; x.cu = {0, 1, 64, 128, 193, 193, 1193}; x.T = 1193;
        check_chunk("  varlen 1,63,64,65,0,1000 int32", x, 16.0, 0, 5e-3, CFG_BV, NCFG(CFG_BV));
    }
    { Problem x = b; x.K = 64; x.V = 64; x.H = 4; check_chunk("  K=V=64 GVA 2", x, 16.0, 0, 5e-3, CFG_BV, NCFG(CFG_BV)); }
    {
        /* K = V = 256 (issue 7 item 4), small: varlen with a partial last
         * chunk, GVA 2, h0 / ht, in-kernel L2 norm; every stage B variant */
        Problem x = b; x.B = 1; x.H = 1; x.HV = 2; x.K = 256; x.V = 256;
        x.cu = {0, 37, 100}; x.T = 100; x.l2norm = 1;
        check_chunk("K=V=256 varlen 37,63 GVA 2 l2norm h0", x, 16.0, 0, 5e-3, CFG_K256, NCFG(CFG_K256));
    }
    if (tiny) return;
    {
        /* K = V = 256 (issue 7 item 4), against the float64 reference: the
         * three-stage forward (stage A's V tile in its own region, stage B
         * K-split only with a 3- or 2-deep ring, stage C 16 warps) */
        Problem x = b; x.K = 256; x.V = 256; x.H = 2; x.HV = 4; x.B = 1;
        x.cu = {0, 1, 64, 128, 193, 193, 493}; x.T = 493;
        check_chunk("K=V=256 bf16 varlen 1,63,64,65,0,300 GVA 2", x, 16.0, 0, 5e-3, CFG_K256, NCFG(CFG_K256));
        x.dt = FQ_F32; x.l2norm = 1;
        check_chunk("K=V=256 fp32 varlen int64 l2norm GVA 2", x, 16.0, 1, 5e-3, CFG_K256, NCFG(CFG_K256));
        Problem y = b; y.K = 256; y.V = 256; y.H = 2; y.HV = 4; y.B = 2; y.T = 200; y.dt = FQ_F32;
        check_chunk("K=V=256 fp32 B=2 T=200 GVA 2 h0", y, 16.0);
        y.dt = FQ_F16; y.has_h0 = 0; y.want_ht = 0; y.T = 130;
        check_chunk("K=V=256 fp16 B=2 T=130 no h0, no ht", y, 16.0);
        Problem z = b; z.K = 256; z.V = 256; z.B = 1; z.H = 1; z.HV = 2; z.T = 2048;
        check_chunk("K=V=256 T=2048 HV=2 (A_h 0 and 16) bf16", z, 16.0, 0, 5e-3, CFG_K256, NCFG(CFG_K256));
    }
    { Problem x = b; x.l2norm = 1; check_chunk("  + use_qk_l2norm", x, 16.0); }
    { Problem x = b; x.has_h0 = 0; x.want_ht = 0; check_chunk("  no h0, no ht", x, 16.0); }
    { Problem x = b; x.dt = FQ_F16; check_chunk("  float16 inputs", x, 16.0); }
    { Problem x = b; x.dt = FQ_F32; check_chunk("  float32 inputs", x, 16.0); }
    { Problem x = b; x.gdt = FQ_BF16; check_chunk("  bf16 gates", x, 16.0); }
    { Problem x = b; x.K = 64; x.V = 64; x.H = 8; check_chunk("  K=V=64 GVA 1", x, 16.0); }
    { Problem x = b; x.K = 64; x.V = 64; x.H = 2; check_chunk("  K=V=64 GVA 4", x, 16.0); }
    { Problem x = b; x.K = 128; x.V = 64; check_chunk("  K=128 V=64", x, 16.0, 0, 5e-3, CFG_BV, NCFG(CFG_BV)); }
    { Problem x = b; x.K = 64; x.V = 128; check_chunk("  K=64 V=128", x, 16.0, 0, 5e-3, CFG_BV, NCFG(CFG_BV)); }
    { Problem x = b; x.B = 3; x.T = 1; check_chunk("  T=1", x, 16.0); }
    {
        Problem x = b; x.B = 1; x.cu = {0, 1, 64, 128, 193, 193, 1193}; x.T = 1193;
        x.l2norm = 1; x.has_h0 = 0;
        check_chunk("  varlen int64 + l2norm, no h0", x, 16.0, 1);
    }
    {
        Problem x = b; x.B = 1; x.cu = {0, 0}; x.T = 0;
        check_chunk("  one empty sequence (ht = h0)", x, 16.0);
    }
    if (!quick) {
        Problem x = b; x.B = 1; x.T = 32768; x.H = 1; x.HV = 2;
        check_chunk("T=32768 H=1 HV=2 (A_h 0 and 16) bf16", x, 16.0, 0, 5e-3, CFG_BV, NCFG(CFG_BV));
        x.K = 64; x.V = 64;
        check_chunk("T=32768 H=1 HV=2 K=V=64", x, 16.0);
        x.K = 128; x.V = 128; x.T = 65536; x.HV = 1;
        check_chunk("T=65536 H=1 HV=1 g=0 (exact CP)", x, 0.0);
    }
}

/* The timed rows: the forward rows of ANCHORS.md (FLA: our H200
 * measurement where there is one, else published) and decode rows. `time`
 * mode (short = 1) runs the rows marked short only. */
struct TimedFwd { int H, HV, nseq, len, varlen; double fla, fqla; int in_short; };
static const TimedFwd TIMED_FWD[] = {
    {16, 32, 1, 32768, 0, 1.920, 1.243, 1}, {16, 32, 8, 1024, 0, 0.507, 0.185, 1},
    {16, 32, 1, 8192, 0, 0.4827, 0.303, 1}, {16, 32, 1, 2048, 0, 0.1345, 0.088, 1},
    {16, 32, 8, 4096, 0, 1.914, 0.643, 1},  {16, 32, 2, 16384, 1, 1.891, 0.776, 0},
    {16, 64, 1, 32768, 0, 3.331, 1.523, 0}, {16, 64, 2, 16384, 1, 3.436, 1.252, 1},
    {2, 8, 1, 32768, 0, 0.904, 0.394, 1},   {2, 8, 1, 4096, 0, 0.1345, 0.133, 1},
    {8, 32, 1, 32768, 0, 1.885, 1.235, 0},  {16, 48, 1, 32768, 0, 2.711, 1.409, 0},
};
struct TimedRec { int N, H, HV, T, in_short, idx, vk; };
static const TimedRec TIMED_REC[] = {
    {1, 16, 32, 1, 1, 0, 0},  {1, 16, 32, 1, 1, 1, 0},   {16, 16, 32, 1, 0, 1, 0}, {64, 16, 32, 1, 1, 0, 0},
    {64, 16, 32, 1, 1, 1, 0}, {256, 16, 32, 1, 1, 1, 0}, {64, 16, 32, 4, 1, 1, 0}, {256, 2, 8, 1, 0, 1, 0},
    {1, 16, 32, 1, 0, 1, 1},  {64, 16, 32, 1, 0, 1, 1},
};

static void run_timings(int short_only)
{
    g_fast_rand = 1;
    printf("timings (CUDA-graph replays, CUDA events, median of 20 after warm-up; ms)\n");
    for (const TimedFwd &r : TIMED_FWD)
        if (!short_only || r.in_short) time_fwd(r.H, r.HV, r.nseq, r.len, r.varlen, r.fla, r.fqla);
    /* K = V = 256 (issue 7 item 4; no FLA / FlashQLA figures: FlashQLA takes 128 only) */
    if (!short_only) {
        time_fwd(16, 32, 1, 8192, 0, NAN, NAN, 256);
        time_fwd(16, 32, 8, 1024, 0, NAN, NAN, 256);
    }
    for (const TimedRec &r : TIMED_REC)
        if (!short_only || r.in_short) time_recurrent(r.N, r.H, r.HV, r.T, r.idx, r.vk);
}

/* One bf16 problem of B sequences of T tokens (fast inputs, h0 and ht), uploaded
 * into *p, and three library forwards of it: `prof` and `timeline`. 0 on failure
 * (the message printed). */
static int run_three_forwards(int H, int HV, int B, int T, fq_gdn_params *p, Dev *d, const char *what)
{
    Problem pb = {};
    pb.B = B; pb.T = T; pb.H = H; pb.HV = HV; pb.K = 128; pb.V = 128;
    pb.dt = FQ_BF16; pb.gdt = FQ_F32; pb.has_h0 = 1; pb.want_ht = 1;
    g_fast_rand = 1;
    make_inputs(pb, 4.0);
    *d = upload_chunk(pb, 0, p);
    for (int i = 0; i < 3; i++)
        if (fq_cuda_chunk_fwd(p) != FQ_OK) { printf("%s: %s\n", what, fq_last_error()); return 0; }
    CK(cudaDeviceSynchronize());
    return 1;
}

/* the recurrent step against the float64 reference (main's full run and `rec`) */
static void recurrent_checks(void)
{
    printf("recurrent step vs float64 reference (o==chunk uses the default variant)\n");
    check_recurrent("N=6 T=1 H=4 HV=8 K=V=128 idx int32", 6, 1, 4, 8, 128, 128, 0, 0, FQ_BF16, 0);
    check_recurrent("N=6 T=4 H=4 HV=8 K=V=128 idx int64", 6, 4, 4, 8, 128, 128, 0, 0, FQ_BF16, 1);
    check_recurrent("N=5 T=3 K=V=64 l2norm GVA 4", 5, 3, 2, 8, 64, 64, 0, 1, FQ_BF16, 0);
    check_recurrent("N=5 T=2 K=128 V=64 fp32", 5, 2, 2, 4, 128, 64, 0, 0, FQ_F32, 0);
    check_recurrent("varlen N=7 (lengths 0,2,4,1,3,5,2) fp16", 7, 5, 4, 8, 128, 128, 1, 0, FQ_F16, 0);
    /* many groups of 4 tokens, each copied into the stage and waited for */
    check_recurrent("N=3 T=150 H=2 HV=4 K=V=128 bf16", 3, 150, 2, 4, 128, 128, 0, 0, FQ_BF16, 0);
    check_recurrent("N=2 T=70 K=V=64 fp32 l2norm", 2, 70, 2, 4, 64, 64, 0, 1, FQ_F32, 0);
    /* K = V = 256 (issue 7 item 4): decode (one token per stage), groups
     * of 4 over several groups, varlen; o==chunk against the forward */
    check_recurrent("N=6 T=1 H=2 HV=4 K=V=256 bf16 idx int32", 6, 1, 2, 4, 256, 256, 0, 0, FQ_BF16, 0);
    check_recurrent("N=3 T=10 H=1 HV=2 K=V=256 fp32 l2norm", 3, 10, 1, 2, 256, 256, 0, 1, FQ_F32, 1);
    check_recurrent("varlen N=7 K=V=256 fp16", 7, 5, 2, 4, 256, 256, 1, 0, FQ_F16, 0);
    /* the [V, K] pool (state_layout "vk") at every K and dtype */
    check_recurrent("vk N=6 T=1 H=4 HV=8 K=V=128 idx int32", 6, 1, 4, 8, 128, 128, 0, 0, FQ_BF16, 0, 1);
    check_recurrent("vk N=5 T=3 K=V=64 l2norm GVA 4", 5, 3, 2, 8, 64, 64, 0, 1, FQ_BF16, 0, 1);
    check_recurrent("vk N=5 T=2 K=128 V=64 fp32", 5, 2, 2, 4, 128, 64, 0, 0, FQ_F32, 0, 1);
    check_recurrent("vk varlen N=7 fp16", 7, 5, 4, 8, 128, 128, 1, 0, FQ_F16, 0, 1);
    check_recurrent("vk N=3 T=10 H=1 HV=2 K=V=256 fp32 l2norm", 3, 10, 1, 2, 256, 256, 0, 1, FQ_F32, 1, 1);
    check_recurrent("K=64 V=128 N=4 T=3 bf16", 4, 3, 2, 4, 64, 128, 0, 0, FQ_BF16, 0);
    check_recurrent("vk K=64 V=128 N=4 T=3 bf16 idx int64", 4, 3, 2, 4, 64, 128, 0, 0, FQ_BF16, 1, 1);
    /* a duplicate slot (the last sequence names sequence 0's): decode (the decode kernel), a group of
     * tokens (the persistent kernel), [V, K], varlen */
    check_recurrent("dup N=6 T=1 H=4 HV=8 K=V=128 bf16", 6, 1, 4, 8, 128, 128, 0, 0, FQ_BF16, 0, 0, 1);
    check_recurrent("dup N=5 T=4 K=V=64 fp32 idx int64", 5, 4, 2, 4, 64, 64, 0, 0, FQ_F32, 1, 0, 1);
    check_recurrent("dup vk N=6 T=1 fp16 l2norm", 6, 1, 2, 4, 128, 128, 0, 1, FQ_F16, 0, 1, 1);
    check_recurrent("dup varlen N=7 bf16", 7, 5, 4, 8, 128, 128, 1, 0, FQ_BF16, 0, 0, 1);
}

int main(int argc, char **argv)
{
    int quick = argc > 1 && strcmp(argv[1], "quick") == 0;
    int tiny = argc > 1 && strcmp(argv[1], "tiny") == 0;
    int race = argc > 1 && strcmp(argv[1], "race") == 0;
    /* `time`: no checks, the forward timings of the rows below 32768 tokens
     * plus 16/32 1x32768, 8x4096 and 16/64 16384+16384 (for A/B runs of the dev switches, one process per
     * setting since the library reads them once) */
    int timeonly = argc > 1 && strcmp(argv[1], "time") == 0;
    /* `rec`: the recurrent step only, its checks and its timed rows (all of
     * them); `rec check`: the checks only (for the sanitizers) */
    if (argc > 1 && strcmp(argv[1], "rec") == 0) {
        check_invalid_cu();
        recurrent_checks();
        g_fast_rand = 1;
        if (argc > 2 && strcmp(argv[2], "check") == 0) {
            printf("correctness: %d checks, %d failed, worst rel %.3e\n", g_stat.n, g_stat.fail, g_stat.worst);
            return g_fail || g_stat.fail ? 1 : 0;
        }
        printf("timings (CUDA-graph replays, CUDA events, median of 20 after warm-up; ms)\n");
        for (const TimedRec &r : TIMED_REC) time_recurrent(r.N, r.H, r.HV, r.T, r.idx, r.vk);
        printf("correctness: %d checks, %d failed, worst rel %.3e\n", g_stat.n, g_stat.fail, g_stat.worst);
        return g_fail || g_stat.fail ? 1 : 0;
    }
#ifdef FQ_FUSED_TIMELINE
    /* `timeline`: per-CTA event clocks of the fused FULL pass (built with
     * -DFQ_FUSED_TIMELINE; gdn_cuda_fwd_fused.cu's FQ_TL events), for a few
     * shapes: medians over CTAs of the steps, and per SM the gaps between one
     * CTA's end and the next one's entry (cycles) */
    if (argc > 1 && strcmp(argv[1], "timeline") == 0) {
        const int shapes[][4] = {{16, 32, 8, 1024}, {16, 32, 8, 4096}, {16, 32, 1, 2048}, {16, 32, 1, 8192}, {16, 64, 2, 16384}};
        for (auto &sh : shapes) {
            fq_gdn_params p;
            Dev d;
            if (!run_three_forwards(sh[0], sh[1], sh[2], sh[3], &p, &d, "timeline")) return 1;
            std::vector<unsigned long long> tl(8192 * 10);
            int n = fq_cuda_fused_timeline(tl.data(), 8192);
            std::vector<int> live;
            for (int c = 0; c < n; c++) if (tl[10 * c]) live.push_back(c);
            const char *nm[7] = {"entry->seg", "seg->S0", "S0->chk0", "chk0->done0", "done0->loop", "loop->stored", "loop->out"};
            const int a[7] = {0, 1, 2, 3, 4, 5, 5}, b[7] = {1, 2, 3, 4, 5, 6, 7};
            printf("timeline %d/%d %dx%d: %zu CTAs (cycles; median / max over CTAs)\n", sh[0], sh[1], sh[2], sh[3], live.size());
            for (int e = 0; e < 7; e++) {
                std::vector<double> v;
                for (int c : live) v.push_back((double)(long long)(tl[10 * c + b[e]] - tl[10 * c + a[e]]));
                std::sort(v.begin(), v.end());
                printf("  %-14s %9.0f %9.0f\n", nm[e], v.empty() ? 0. : v[v.size() / 2], v.empty() ? 0. : v.back());
            }
            /* per SM: CTAs in entry order; gap = next entry - max(end state stored, output done) */
            std::vector<double> gaps, life;
            for (int sm = 0; sm < 256; sm++) {
                std::vector<std::pair<unsigned long long, int>> q;
                for (int c : live) if ((int)tl[10 * c + 8] == sm) q.push_back({tl[10 * c], c});
                std::sort(q.begin(), q.end());
                for (size_t i = 0; i < q.size(); i++) {
                    const int c = q[i].second;
                    const unsigned long long end = std::max(tl[10 * c + 6], tl[10 * c + 7]);
                    life.push_back((double)(end - tl[10 * c]));
                    if (i + 1 < q.size()) gaps.push_back((double)(long long)(q[i + 1].first - end));
                }
            }
            std::sort(gaps.begin(), gaps.end());
            std::sort(life.begin(), life.end());
            printf("  CTA life median %.0f, gap end->next entry median %.0f max %.0f (%zu gaps)\n",
                   life.empty() ? 0. : life[life.size() / 2], gaps.empty() ? 0. : gaps[gaps.size() / 2],
                   gaps.empty() ? 0. : gaps.back(), gaps.size());
            free_dev(d);
        }
        return 0;
    }
#endif
    /* `prof H HV T`: three forwards of one sequence, nothing else (for ncu) */
    if (argc > 1 && strcmp(argv[1], "prof") == 0) {
        fq_gdn_params p;
        Dev d;
        /* prof [H HV T [B]]: B sequences of T tokens */
        if (!run_three_forwards(argc > 2 ? atoi(argv[2]) : 16, argc > 3 ? atoi(argv[3]) : 32,
                                argc > 5 ? atoi(argv[5]) : 1, argc > 4 ? atoi(argv[4]) : 8192, &p, &d, "prof"))
            return 1;
        printf("prof: done\n");
        free_dev(d);
        return 0;
    }
    if (race) tiny = 1;
    if (tiny) quick = 1;
    g_stat.worst = 0;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount);
    printf("programmatic dependent launch in the forward: %s\n", fq_cuda_pdl_enabled() ? "on" : "off");

    if (timeonly) {
        run_timings(1);
        quick = 1;
        tiny = 1;
    } else {
        printf("chunked forward vs float64 reference ([auto]: as the library runs it; [bvNN ksN]: stage B "
               "columns, K-split forced)\n");
        if (!race && fq_cuda_fwd_fused_available(NULL_SHAPE_128())) {
            check_inverse(128, 0);
            check_inverse(128, 1);
            check_inverse(64, 0);
        }
        chunk_suite(quick, tiny, race);
    }
    if (tiny && !race && !timeonly) {
        /* memcheck / forced JIT of the recurrent step at K = V = 256 (issue 7
         * item 4; its 2-block, 32 KB-per-stage instantiations): decode and
         * a group of 4 tokens, with o==chunk against the forward */
        printf("recurrent step, K = V = 256\n");
        check_recurrent("tiny: N=3 T=1 K=V=256 bf16", 3, 1, 1, 2, 256, 256, 0, 0, FQ_BF16, 0);
        check_recurrent("tiny: N=2 T=5 K=V=256 fp32 l2norm", 2, 5, 1, 2, 256, 256, 0, 1, FQ_F32, 0);
    }
    if (!tiny) {
        printf("errors\n");
        check_errors();
        check_invalid_cu();
        recurrent_checks();
    }

    if (!quick) run_timings(0);

    printf("\n==== summary ====\n");
    printf("correctness: %d checks, %d failed, worst rel %.3e\n", g_stat.n, g_stat.fail, g_stat.worst);
    if (!g_rows.empty()) {
        printf("%-22s %6s %6s | %6s %6s %6s | %6s %6s | %6s\n", "shape (ms)", "FQLA", "FLA", "total", "FQLA/t",
               "FLA/t", "inv", "fused", "3stage");
        for (const TimeRow &r : g_rows)
            printf("%-22s %6.3f %6.3f | %6.3f %6.2f %6.2f | %6.3f %6.3f | %6.3f\n", r.shape, r.fqla, r.fla, r.tot,
                   r.fqla / r.tot, r.fla / r.tot, r.inv, r.fused, r.old);
        printf("(FQLA: FlashQLA 0.1.3 and FLA as measured side by side in ../shared/ANCHORS.md (not this run);\n"
               " total = fq_cuda_chunk_fwd; inv, fused = the fused forward's two kernels; 3stage = the\n"
               " three-stage forward of GPUs without the fused kernel)\n");
    }
    printf("%s\n", g_fail ? "SOME CHECKS FAILED" : "all checks passed");
    return g_fail;
}
