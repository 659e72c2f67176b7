/*
 * check_fwd_wy.cu — stage A's persistent kernel (fq_cuda_fwd_wy_persistent) against the blocked one (fq_cuda_fwd_wy_blocked)
 * on the same prepared workspace: A (bf16), W, U (bf16), gamma, kdecay (fp32)
 * of every real chunk tile must agree to bf16 rounding noise (the persistent kernel changes only
 * the fp32 association order of the off-diagonal blocks of A); then times
 * both (CUDA events, median of 20) at H/HV = 16/32, K = V = 128.
 *
 * Build and run from the repo root on the GPU machine:
 *   B=/tmp/fqwy; mkdir -p $B; gcc -std=c11 -O2 -c csrc/gdn_common.c -o $B/gdn_common.o
 *   nvcc -std=c++17 -O3 --use_fast_math -Icsrc -gencode arch=compute_90a,code=sm_90a \
 *     -o $B/check_fwd_wy dev/cuda/check_fwd_wy.cu csrc/cuda/gdn_cuda_fwd.cu csrc/cuda/gdn_cuda_fwd_wy.cu \
 *     csrc/cuda/gdn_cuda_fwd_state.cu csrc/cuda/gdn_cuda_fwd_output.cu csrc/cuda/gdn_cuda_fwd_fused.cu \
 *     csrc/cuda/gdn_cuda_fwd_checkpoints.cu csrc/cuda/gdn_cuda_gates.cu csrc/cuda/gdn_cuda_recurrent.cu \
 *     csrc/cuda/gdn_cuda_commit.cu csrc/cuda/gdn_cuda_runtime.cu $B/gdn_common.o
 *   $B/check_fwd_wy          # exit 0: all ok
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <vector>
#include <algorithm>

#include "cuda/gdn_cuda_common.cuh"
#include "check_common.h"


static int g_fail = 0;

static float bf2f(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static uint16_t f2bf(float f)
{
    uint32_t u; memcpy(&u, &f, 4);
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

struct Case {
    const char *name;
    int B, T, H, HV, K, V;
    fq_dtype dt, gdt;
    int l2norm;
    std::vector<int> cu; /* empty: none */
    int timed;
};

/* uploads n values of dtype dt (bf16 or f32) from doubles */
static void *upload(const std::vector<double> &x, fq_dtype dt)
{
    void *d = NULL;
    size_t n = x.size();
    if (dt == FQ_BF16) {
        std::vector<uint16_t> h(n);
        for (size_t i = 0; i < n; i++) h[i] = f2bf((float)x[i]);
        CK(cudaMalloc(&d, n * 2 + 16)); CK(cudaMemcpy(d, h.data(), n * 2, cudaMemcpyHostToDevice));
    } else {
        std::vector<float> h(n);
        for (size_t i = 0; i < n; i++) h[i] = (float)x[i];
        CK(cudaMalloc(&d, n * 4 + 16)); CK(cudaMemcpy(d, h.data(), n * 4, cudaMemcpyHostToDevice));
    }
    return d;
}

static std::vector<float> dl_bf16(const void *d, size_t n)
{
    std::vector<uint16_t> h(n);
    CK(cudaMemcpy(h.data(), d, n * 2, cudaMemcpyDeviceToHost));
    std::vector<float> f(n);
    for (size_t i = 0; i < n; i++) f[i] = bf2f(h[i]);
    return f;
}
static std::vector<float> dl_f32(const void *d, size_t n)
{
    std::vector<float> f(n);
    CK(cudaMemcpy(f.data(), d, n * 4, cudaMemcpyDeviceToHost));
    return f;
}

/* the persistent kernel with U (the form compared against the blocked one) */
static fq_status fq_wy_persistent_with_u(const fq_gdn_params *p, const fq_fwd_ws *ws, cudaStream_t s)
{
    return fq_cuda_fwd_wy_persistent(p, ws, 1, s);
}

static float time_ms(fq_status (*fn)(const fq_gdn_params *, const fq_fwd_ws *, cudaStream_t),
                     const fq_gdn_params *p, const fq_fwd_ws *ws)
{
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
    std::vector<float> ms;
    for (int r = 0; r < 23; r++) {
        CK(cudaEventRecord(a, 0));
        if (fn(p, ws, 0) != FQ_OK) { fprintf(stderr, "timed call failed: %s\n", fq_last_error()); exit(2); }
        CK(cudaEventRecord(b, 0));
        CK(cudaEventSynchronize(b));
        float t = 0; CK(cudaEventElapsedTime(&t, a, b));
        if (r >= 3) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    CK(cudaEventDestroy(a)); CK(cudaEventDestroy(b));
    return ms[ms.size() / 2];
}

static void run_case(const Case &c)
{
    const int N = c.cu.empty() ? c.B : (int)c.cu.size() - 1;
    const size_t nq = (size_t)c.B * c.T * c.H * c.K, nv = (size_t)c.B * c.T * c.HV * c.V, ng = (size_t)c.B * c.T * c.HV;
    std::vector<double> k(nq), v(nv), g(ng), beta(ng);
    std::vector<double> A(c.HV);
    for (int h = 0; h < c.HV; h++) A[h] = c.HV > 1 ? 8.0 * h / (c.HV - 1) : 1.0;
    for (size_t row = 0; row < (size_t)c.B * c.T * c.H; row++) {
        double s = 0;
        for (int i = 0; i < c.K; i++) { k[row * c.K + i] = nrand(); s += k[row * c.K + i] * k[row * c.K + i]; }
        if (!c.l2norm)
            for (int i = 0; i < c.K; i++) k[row * c.K + i] /= sqrt(s);
    }
    for (size_t i = 0; i < nv; i++) v[i] = nrand();
    for (size_t i = 0; i < ng; i++) {
        int h = (int)(i % c.HV);
        g[i] = -A[h] * log1p(exp(0.5 * nrand() + 1.0));
        beta[i] = 1.0 / (1.0 + exp(-nrand()));
    }
    fq_gdn_params p;
    fq_params_init(&p);
    p.B = c.B; p.T = c.T; p.H = c.H; p.HV = c.HV; p.K = c.K; p.V = c.V; p.N = N; p.P = N;
    p.dtype = c.dt; p.gate_dtype = c.gdt; p.state_dtype = FQ_F32;
    p.scale = 1.0 / sqrt((double)c.K); p.use_qk_l2norm = c.l2norm;
    p.q = upload(k, c.dt); /* q is not read by stages 0/A beyond its norms */
    p.k = upload(k, c.dt);
    p.v = upload(v, c.dt);
    p.g = upload(g, c.gdt);
    p.beta = upload(beta, c.gdt);
    void *dcu = NULL;
    if (!c.cu.empty()) {
        CK(cudaMalloc(&dcu, c.cu.size() * 4));
        CK(cudaMemcpy(dcu, c.cu.data(), c.cu.size() * 4, cudaMemcpyHostToDevice));
        p.cu_seqlens = dcu; p.cu_seqlens_is_int64 = 0;
    }
    size_t wsb = fq_cuda_chunk_fwd_workspace_bytes(&p);
    void *wsp = NULL;
    CK(cudaMalloc(&wsp, wsb));
    p.workspace = wsp; p.workspace_bytes = wsb;
    fq_fwd_ws ws;
    fq_cuda_fwd_ws_layout(&p, wsp, &ws);
    const size_t ntile = (size_t)ws.nc_max * c.HV;
    fq_bf16 *da = NULL;
    CK(cudaMalloc(&da, ntile * 64 * 64 * 2));
    ws.a = da;
    if (fq_cuda_fwd_prepare(&p, &ws, 0) != FQ_OK) { printf("%s: prepare failed: %s\n", c.name, fq_last_error()); exit(2); }
    CK(cudaDeviceSynchronize());
    std::vector<fq_chunk_info> chunks(ws.nc_max);
    CK(cudaMemcpy(chunks.data(), ws.chunks, ws.nc_max * sizeof(fq_chunk_info), cudaMemcpyDeviceToHost));

    std::vector<float> res[2][5];
    for (int ver = 0; ver < 2; ver++) {
        CK(cudaMemset(ws.w, 0xff, ntile * 64 * c.K * 2));
        CK(cudaMemset(ws.u, 0xff, ntile * 64 * c.V * 2));
        CK(cudaMemset(ws.gamma, 0xff, ntile * 64 * 4));
        CK(cudaMemset(ws.kdecay, 0xff, ntile * 64 * 4));
        CK(cudaMemset(da, 0xff, ntile * 64 * 64 * 2));
        fq_status st = ver ? fq_cuda_fwd_wy_persistent(&p, &ws, 1, 0) : fq_cuda_fwd_wy_blocked(&p, &ws, 0);
        CK(cudaDeviceSynchronize());
        if (st != FQ_OK) { printf("%s: v%d failed: %s\n", c.name, ver + 2, fq_last_error()); g_fail = 1; return; }
        res[ver][0] = dl_bf16(da, ntile * 64 * 64);
        res[ver][1] = dl_bf16(ws.w, ntile * 64 * c.K);
        res[ver][2] = dl_bf16(ws.u, ntile * 64 * c.V);
        res[ver][3] = dl_f32(ws.gamma, ntile * 64);
        res[ver][4] = dl_f32(ws.kdecay, ntile * 64);
    }
    const char *what[5] = {"A", "W", "U", "gamma", "kdecay"};
    const double tol[5] = {4e-3, 4e-3, 4e-3, 1e-6, 1e-6};
    for (int i = 0; i < 5; i++) {
        size_t per = res[0][i].size() / ntile;
        double num = 0, den = 0, maxd = 0;
        size_t bad = 0, nreal = 0;
        for (size_t t = 0; t < ntile; t++) {
            if (chunks[t / c.HV].seq < 0) continue;
            nreal++;
            for (size_t e = 0; e < per; e++) {
                double x = res[1][i][t * per + e], y = res[0][i][t * per + e];
                if (!std::isfinite(x) || !std::isfinite(y)) { bad++; continue; }
                num += (x - y) * (x - y); den += y * y;
                maxd = std::max(maxd, fabs(x - y));
            }
        }
        double rel = den > 0 ? sqrt(num / den) : sqrt(num);
        int ok = bad == 0 && rel <= tol[i] && nreal > 0;
        if (!ok) g_fail = 1;
        printf("  %-34s %-7s persistent vs blocked rel %.3e max|d| %.3e nonfinite %zu tiles %zu %s\n", c.name, what[i], rel, maxd,
               bad, nreal, ok ? "ok" : "FAIL");
    }
    if (c.timed) {
        ws.a = NULL; /* the forward's configuration */
        float t2 = time_ms(fq_cuda_fwd_wy_blocked, &p, &ws), t3 = time_ms(fq_wy_persistent_with_u, &p, &ws);
        ws.a = da;
        float t2a = time_ms(fq_cuda_fwd_wy_blocked, &p, &ws), t3a = time_ms(fq_wy_persistent_with_u, &p, &ws);
        printf("  %-34s time (ms, events, median): blocked %.4f  persistent %.4f  (with A out: blocked %.4f  persistent %.4f)\n", c.name, t2, t3,
               t2a, t3a);
    }
    cudaFree(da); cudaFree(wsp); if (dcu) cudaFree(dcu);
    cudaFree((void *)p.q); cudaFree((void *)p.k); cudaFree((void *)p.v); cudaFree((void *)p.g); cudaFree((void *)p.beta);
}

int main(void)
{
    std::vector<Case> cases;
    cases.push_back({"2/4 B2 T1000 K128 V128 bf16", 2, 1000, 2, 4, 128, 128, FQ_BF16, FQ_F32, 0, {}, 0});
    cases.push_back({"2/8 varlen K64 V128 bf16/bf16g", 1, 2000, 2, 8, 64, 128, FQ_BF16, FQ_BF16, 0,
                     {0, 1, 65, 130, 130, 777, 2000}, 0});
    cases.push_back({"1/1 T300 K128 V64 l2norm", 1, 300, 1, 1, 128, 64, FQ_BF16, FQ_F32, 1, {}, 0});
    cases.push_back({"4/4 B3 T320 K64 V64 f32", 3, 320, 4, 4, 64, 64, FQ_F32, FQ_F32, 0, {}, 0});
    cases.push_back({"2/6 varlen T63 K128 V128", 1, 63, 2, 6, 128, 128, FQ_BF16, FQ_F32, 1, {0, 1, 2, 63}, 0});
    cases.push_back({"16/32 1x2048", 1, 2048, 16, 32, 128, 128, FQ_BF16, FQ_F32, 0, {}, 1});
    cases.push_back({"16/32 1x8192", 1, 8192, 16, 32, 128, 128, FQ_BF16, FQ_F32, 0, {}, 1});
    cases.push_back({"16/32 1x32768", 1, 32768, 16, 32, 128, 128, FQ_BF16, FQ_F32, 0, {}, 1});
    cases.push_back({"16/64 1x32768", 1, 32768, 16, 64, 128, 128, FQ_BF16, FQ_F32, 0, {}, 1});
    for (size_t i = 0; i < cases.size(); i++) run_case(cases[i]);
    printf("%s\n", g_fail ? "FAIL" : "all ok");
    return g_fail;
}
