/*
 * check_bwd.cu — standalone check and timing of the CUDA chunked backward
 * (csrc/cuda/gdn_cuda_bwd.cu) against a float64 token-by-token reference
 * (forward recurrence of DESIGN §1 + reverse mode through it, BPTT with a
 * checkpoint every 64 tokens). Build (repository root):
 *
 *   gcc -std=c11 -O2 -c csrc/gdn_common.c -o /tmp/gdn_common.o
 *   nvcc -std=c++17 -O3 -lineinfo --use_fast_math -Xcompiler -fopenmp \
 *        -gencode arch=compute_90a,code=sm_90a -Icsrc dev/cuda/check_bwd.cu \
 *        csrc/cuda/gdn_cuda_bwd*.cu csrc/cuda/gdn_cuda_fwd*.cu /tmp/gdn_common.o \
 *        -o /tmp/check_bwd -lgomp
 *   /tmp/check_bwd          (all checks, then timing)
 *   /tmp/check_bwd time     (timing only)
 *   /tmp/check_bwd small    (five small cases, one at K = V = 256, for compute-sanitizer)
 * or simply: bash dev/cuda/run_check_bwd.sh
 *
 * It checks the one backward the library has (the measured one of
 * benchmarks/NOTES.md; versions 1-5 were removed, see git history, commit
 * 4599409). FLASHQLA_CUDA_BWD_STATE=BV:KS in the environment forces a
 * configuration of the reverse state pass (gdn_cuda_bwd_state.cu).
 *
 * Inputs follow DESIGN §3 (q, k L2-normalised unless the operator does it,
 * beta = sigmoid(randn), g = -A_h softplus(0.5 randn + 1), A_h from 0 to 16);
 * outputs are NaN-poisoned first; rel = ||out - ref|| / ||ref||; dq, dk, dv,
 * dbeta, dh0 <= 1e-2, dg <= 2e-2, and no NaN/Inf anywhere. Exit status 1 on any
 * failure.
 */
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>
#include <string>
#include <algorithm>

#include "gdn.h"
#include "check_common.h"

extern "C" fq_status fq_cuda_bwd_run(const fq_gdn_params *p, cudaEvent_t *ev);
#ifdef FQ_REV_TRACE
extern "C" cudaError_t fq_rev_trace_copy(long long t[8][32]);
/* bwd_rev90's per-role clock trace (a dev build with -DFQ_REV_TRACE), relative to the
 * producer's first KA issue (slot 26 of chunk 0), -1 where not recorded; the lines that
 * dev/cuda/trace_rev.py digests */
static void rev_trace_print(void)
{
    long long h[8][32];
    if (fq_rev_trace_copy(h) != cudaSuccess) { printf("trace: copy failed\n"); return; }
    const long long t0 = h[0][26];
    for (int c = 0; c < 8; c++) {
        printf("trace chunk %d:", c);
        for (int k = 0; k < 29; k++) printf(" %lld", h[c][k] ? (h[c][k] - t0) : -1);
        printf("\n");
    }
}
#endif


/* ------------------------------------------------------------ random ---- */

/* ------------------------------------------------------ dtype on host ---- */
static size_t dsz(fq_dtype d) { return d == FQ_F32 ? 4 : d == FQ_F64 ? 8 : 2; }
static double round_to(fq_dtype d, double x)
{
    if (d == FQ_BF16) return (double)__bfloat162float(__float2bfloat16_rn((float)x));
    if (d == FQ_F16) return (double)__half2float(__float2half_rn((float)x));
    if (d == FQ_F32) return (double)(float)x;
    return x;
}
static void put(fq_dtype d, void *p, size_t i, double x)
{
    if (d == FQ_BF16) ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn((float)x);
    else if (d == FQ_F16) ((__half *)p)[i] = __float2half_rn((float)x);
    else if (d == FQ_F32) ((float *)p)[i] = (float)x;
    else ((double *)p)[i] = x;
}
static double get(fq_dtype d, const void *p, size_t i)
{
    if (d == FQ_BF16) return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
    if (d == FQ_F16) return __half2float(((const __half *)p)[i]);
    if (d == FQ_F32) return ((const float *)p)[i];
    return ((const double *)p)[i];
}

/* ---------------------------------------------------------- the case ---- */
struct Case {
    const char *name;
    int B, T, H, HV, K, V;
    std::vector<int> seqlens; /* non-empty: cu_seqlens, B = 1 */
    int l2norm, use_h0, use_dht;
    fq_dtype dt;
    double amax; /* A_h of the last head (heads spread 0..amax) */
};

struct Host {
    int N, BT;
    std::vector<int> bos, lens;
    std::vector<double> q, k, v, g, beta, h0, dout, dht;     /* as used (rounded) */
    std::vector<double> dq, dk, dv, dg, dbeta, dh0;         /* reference */
};

static void make_inputs(const Case &c, Host &h)
{
    if (c.seqlens.empty()) {
        h.N = c.B;
        for (int b = 0; b < c.B; b++) { h.bos.push_back(b * c.T); h.lens.push_back(c.T); }
        h.BT = c.B * c.T;
    } else {
        h.N = (int)c.seqlens.size();
        int off = 0;
        for (int L : c.seqlens) { h.bos.push_back(off); h.lens.push_back(L); off += L; }
        h.BT = off;
    }
    const int BT = h.BT, H = c.H, HV = c.HV, K = c.K, V = c.V, N = h.N;
    h.q.resize((size_t)BT * H * K); h.k.resize(h.q.size());
    h.v.resize((size_t)BT * HV * V); h.dout.resize(h.v.size());
    h.g.resize((size_t)BT * HV); h.beta.resize(h.g.size());
    h.h0.assign((size_t)N * HV * K * V, 0.0); h.dht.assign(h.h0.size(), 0.0);
    for (size_t i = 0; i < (size_t)BT * H; i++) {
        for (int which = 0; which < 2; which++) {
            std::vector<double> &x = which ? h.k : h.q;
            double ss = 0;
            for (int e = 0; e < K; e++) { x[i * K + e] = nrand(); ss += x[i * K + e] * x[i * K + e]; }
            for (int e = 0; e < K; e++) {
                double y = c.l2norm ? x[i * K + e] : x[i * K + e] / sqrt(ss);
                x[i * K + e] = round_to(c.dt, y);
            }
        }
    }
    for (auto &x : h.v) x = round_to(c.dt, nrand());
    for (auto &x : h.dout) x = round_to(c.dt, nrand());
    for (int t = 0; t < BT; t++)
        for (int j = 0; j < HV; j++) {
            double A = HV > 1 ? c.amax * j / (HV - 1) : c.amax;
            double z = 0.5 * nrand() + 1;
            double sp = z > 30 ? z : log1p(exp(z));
            h.g[(size_t)t * HV + j] = (double)(float)(-A * sp);
            h.beta[(size_t)t * HV + j] = (double)(float)(1 / (1 + exp(-nrand())));
        }
    if (c.use_h0) for (auto &x : h.h0) x = (double)(float)(0.5 * nrand());
    if (c.use_dht) for (auto &x : h.dht) x = (double)(float)(0.1 * nrand());
}

/* Timing inputs (values do not matter, only their distribution): the same
 * recipe, generated in parallel from a hash of the index. */
static double hrand_u(uint64_t i)
{
    uint64_t z = i * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return ((z >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}
static double hrand_n(uint64_t i) { return sqrt(-2 * log(hrand_u(2 * i))) * cos(6.283185307179586 * hrand_u(2 * i + 1)); }

static void make_inputs_fast(const Case &c, Host &h)
{
    h.N = c.B;
    for (int b = 0; b < c.B; b++) { h.bos.push_back(b * c.T); h.lens.push_back(c.T); }
    h.BT = c.B * c.T;
    const int64_t BT = h.BT, H = c.H, HV = c.HV, K = c.K, V = c.V, N = h.N;
    h.q.resize((size_t)BT * H * K); h.k.resize(h.q.size());
    h.v.resize((size_t)BT * HV * V); h.dout.resize(h.v.size());
    h.g.resize((size_t)BT * HV); h.beta.resize(h.g.size());
    h.h0.assign((size_t)N * HV * K * V, 0.0); h.dht.assign(h.h0.size(), 0.0);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < BT * H; i++) {
        for (int which = 0; which < 2; which++) {
            std::vector<double> &x = which ? h.k : h.q;
            double ss = 0;
            for (int e = 0; e < K; e++) {
                x[i * K + e] = hrand_n((uint64_t)(which * BT * H + i) * K + e);
                ss += x[i * K + e] * x[i * K + e];
            }
            for (int e = 0; e < K; e++) x[i * K + e] = round_to(c.dt, x[i * K + e] / sqrt(ss));
        }
    }
    const uint64_t o1 = (uint64_t)4 * BT * H * K;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < BT * HV * V; i++) {
        h.v[i] = round_to(c.dt, hrand_n(o1 + i));
        h.dout[i] = round_to(c.dt, hrand_n(o1 + BT * HV * V + i));
    }
    const uint64_t o2 = o1 + (uint64_t)2 * BT * HV * V;
    for (int64_t t = 0; t < BT; t++)
        for (int j = 0; j < HV; j++) {
            const int64_t i = t * HV + j;
            double A = HV > 1 ? c.amax * j / (HV - 1) : c.amax;
            double z = 0.5 * hrand_n(o2 + i) + 1;
            double sp = z > 30 ? z : log1p(exp(z));
            h.g[i] = (double)(float)(-A * sp);
            h.beta[i] = (double)(float)(1 / (1 + exp(-hrand_n(o2 + BT * HV + i))));
        }
    for (size_t i = 0; i < h.h0.size(); i++) {
        if (c.use_h0) h.h0[i] = (double)(float)(0.5 * hrand_n(o2 + 2 * BT * HV + i));
        if (c.use_dht) h.dht[i] = (double)(float)(0.1 * hrand_n(o2 + 2 * BT * HV + h.h0.size() + i));
    }
}

/* float64 reference: forward recurrence + reverse mode, per (sequence, value
 * head); checkpoints of S every 64 tokens. */
static void reference(const Case &c, Host &h, double scale)
{
    const int H = c.H, HV = c.HV, K = c.K, V = c.V, G = HV / H, BT = h.BT, N = h.N;
    const size_t KV = (size_t)K * V;
    h.dq.assign((size_t)BT * H * K, 0); h.dk.assign(h.dq.size(), 0);
    h.dv.assign((size_t)BT * HV * V, 0); h.dg.assign((size_t)BT * HV, 0); h.dbeta.assign(h.dg.size(), 0);
    h.dh0.assign((size_t)N * HV * KV, 0);
    /* normalised q, k */
    std::vector<double> qn(h.q), kn(h.k), rq((size_t)BT * H, 1.0), rk((size_t)BT * H, 1.0);
    if (c.l2norm) {
        for (size_t i = 0; i < (size_t)BT * H; i++) {
            double sq = 0, sk = 0;
            for (int e = 0; e < K; e++) { sq += h.q[i * K + e] * h.q[i * K + e]; sk += h.k[i * K + e] * h.k[i * K + e]; }
            rq[i] = 1 / sqrt(sq + 1e-6); rk[i] = 1 / sqrt(sk + 1e-6);
            for (int e = 0; e < K; e++) { qn[i * K + e] *= rq[i]; kn[i * K + e] *= rk[i]; }
        }
    }
    /* per value head partials of dq_hat, dk_hat (summed over groups later) */
    std::vector<double> dqp((size_t)BT * HV * K, 0), dkp((size_t)BT * HV * K, 0);
#pragma omp parallel for schedule(dynamic) collapse(2)
    for (int n = 0; n < N; n++)
        for (int j = 0; j < HV; j++) {
            const int T = h.lens[n], bos = h.bos[n], hq = j / G;
            const int nck = (T + 63) / 64;
            std::vector<double> S(KV), ck((size_t)(nck + 1) * KV), seg((size_t)65 * KV), dS(KV), kS(V), u(V), du(V), dkS(V);
            for (size_t i = 0; i < KV; i++) S[i] = h.h0[((size_t)n * HV + j) * KV + i];
            auto step = [&](int t, const double *Sp, double *Sn) {
                const size_t row = (size_t)(bos + t);
                const double *kk = &kn[(row * H + hq) * K];
                const double *vv = &h.v[(row * HV + j) * V];
                const double a = exp(h.g[row * HV + j]), b = h.beta[row * HV + j];
                for (int e = 0; e < V; e++) kS[e] = 0;
                for (int i = 0; i < K; i++) for (int e = 0; e < V; e++) kS[e] += Sp[(size_t)i * V + e] * kk[i];
                for (int e = 0; e < V; e++) u[e] = b * (vv[e] - a * kS[e]);
                for (int i = 0; i < K; i++) for (int e = 0; e < V; e++) Sn[(size_t)i * V + e] = a * Sp[(size_t)i * V + e] + kk[i] * u[e];
            };
            std::vector<double> tmp(KV);
            for (int t = 0; t < T; t++) {
                if (t % 64 == 0) memcpy(&ck[(size_t)(t / 64) * KV], S.data(), KV * 8);
                step(t, S.data(), tmp.data());
                S.swap(tmp);
            }
            for (size_t i = 0; i < KV; i++) dS[i] = h.dht[((size_t)n * HV + j) * KV + i];
            for (int cI = nck - 1; cI >= 0; cI--) {
                const int t0 = cI * 64, t1 = std::min(T, t0 + 64);
                memcpy(&seg[0], &ck[(size_t)cI * KV], KV * 8);
                for (int t = t0; t < t1; t++) step(t, &seg[(size_t)(t - t0) * KV], &seg[(size_t)(t - t0 + 1) * KV]);
                for (int t = t1 - 1; t >= t0; t--) {
                    const double *Sp = &seg[(size_t)(t - t0) * KV], *Sn = &seg[(size_t)(t - t0 + 1) * KV];
                    const size_t row = (size_t)(bos + t);
                    const double *qq = &qn[(row * H + hq) * K], *kk = &kn[(row * H + hq) * K];
                    const double *vv = &h.v[(row * HV + j) * V], *dd = &h.dout[(row * HV + j) * V];
                    const double a = exp(h.g[row * HV + j]), b = h.beta[row * HV + j];
                    double *dqr = &dqp[(row * HV + j) * K], *dkr = &dkp[(row * HV + j) * K];
                    /* o = scale S_t^T q */
                    for (int i = 0; i < K; i++) {
                        double s = 0;
                        for (int e = 0; e < V; e++) { s += Sn[(size_t)i * V + e] * dd[e]; dS[(size_t)i * V + e] += scale * qq[i] * dd[e]; }
                        dqr[i] += scale * s;
                    }
                    /* recompute kS, u */
                    for (int e = 0; e < V; e++) kS[e] = 0;
                    for (int i = 0; i < K; i++) for (int e = 0; e < V; e++) kS[e] += Sp[(size_t)i * V + e] * kk[i];
                    for (int e = 0; e < V; e++) u[e] = b * (vv[e] - a * kS[e]);
                    /* S_t = a S_{t-1} + k u^T */
                    double da = 0;
                    for (int e = 0; e < V; e++) du[e] = 0;
                    for (int i = 0; i < K; i++) {
                        double s = 0;
                        for (int e = 0; e < V; e++) {
                            const double x = dS[(size_t)i * V + e];
                            du[e] += x * kk[i];
                            s += x * u[e];
                            da += x * Sp[(size_t)i * V + e];
                        }
                        dkr[i] += s;
                    }
                    /* u = b (v - a kS) */
                    double db = 0;
                    for (int e = 0; e < V; e++) {
                        h.dv[(row * HV + j) * V + e] = b * du[e];
                        db += du[e] * (vv[e] - a * kS[e]);
                        dkS[e] = -b * a * du[e];
                        da += -b * du[e] * kS[e];
                    }
                    h.dbeta[row * HV + j] = db;
                    h.dg[row * HV + j] = a * da;
                    /* kS = S_{t-1}^T k;  dS_{t-1} = a dS + k dkS^T */
                    for (int i = 0; i < K; i++) {
                        double s = 0;
                        for (int e = 0; e < V; e++) {
                            s += Sp[(size_t)i * V + e] * dkS[e];
                            dS[(size_t)i * V + e] = a * dS[(size_t)i * V + e] + kk[i] * dkS[e];
                        }
                        dkr[i] += s;
                    }
                }
            }
            for (size_t i = 0; i < KV; i++) h.dh0[((size_t)n * HV + j) * KV + i] = dS[i];
        }
    for (int t = 0; t < BT; t++)
        for (int hq = 0; hq < H; hq++) {
            const size_t vi = (size_t)t * H + hq;
            for (int which = 0; which < 2; which++) {
                std::vector<double> &part = which ? dkp : dqp;
                std::vector<double> &out = which ? h.dk : h.dq;
                const std::vector<double> &raw = which ? h.k : h.q;
                const double r = which ? rk[vi] : rq[vi];
                std::vector<double> d(K, 0);
                for (int jj = 0; jj < G; jj++)
                    for (int e = 0; e < K; e++) d[e] += part[((size_t)t * HV + hq * G + jj) * K + e];
                if (c.l2norm) {
                    double dot = 0;
                    for (int e = 0; e < K; e++) dot += raw[vi * K + e] * r * d[e];
                    for (int e = 0; e < K; e++) d[e] = r * (d[e] - raw[vi * K + e] * r * dot);
                }
                for (int e = 0; e < K; e++) out[vi * K + e] = d[e];
            }
        }
}

/* ------------------------------------------------------- device side ---- */
struct Dev {
    void *q, *k, *v, *g, *beta, *dout, *dq, *dk, *dv, *dg, *dbeta;
    float *h0, *dht, *dh0;
    int *cu;
    void *ws;
    size_t wsb;
};

static void *upload(const std::vector<double> &x, fq_dtype d)
{
    std::vector<char> buf(x.size() * dsz(d) + 16);
    for (size_t i = 0; i < x.size(); i++) put(d, buf.data(), i, x[i]);
    void *p = NULL;
    CK(cudaMalloc(&p, buf.size()));
    CK(cudaMemcpy(p, buf.data(), buf.size(), cudaMemcpyHostToDevice));
    return p;
}
static void *poisoned(size_t n, fq_dtype d)
{
    void *p = NULL;
    CK(cudaMalloc(&p, n * dsz(d) + 16));
    CK(cudaMemset(p, 0xff, n * dsz(d) + 16)); /* NaN in every float format */
    return p;
}
static std::vector<double> download(const void *p, size_t n, fq_dtype d)
{
    std::vector<char> buf(n * dsz(d) + 16);
    CK(cudaMemcpy(buf.data(), p, n * dsz(d), cudaMemcpyDeviceToHost));
    std::vector<double> x(n);
    for (size_t i = 0; i < n; i++) x[i] = get(d, buf.data(), i);
    return x;
}

static void setup(const Case &c, const Host &h, fq_gdn_params &p, Dev &d, double scale)
{
    memset(&d, 0, sizeof d);
    fq_params_init(&p);
    p.B = c.seqlens.empty() ? c.B : 1;
    p.T = c.seqlens.empty() ? c.T : h.BT;
    p.H = c.H; p.HV = c.HV; p.K = c.K; p.V = c.V; p.N = h.N;
    p.dtype = c.dt; p.gate_dtype = FQ_F32; p.state_dtype = FQ_F32;
    p.scale = scale; p.use_qk_l2norm = c.l2norm;
    /* F64: only the refusal is checked, on buffers of float64's size (bf16-sized ones
     * would overlap as float64 extents, and the aliasing check would answer first) */
    const fq_dtype dt = c.dt;
    d.q = upload(h.q, dt); d.k = upload(h.k, dt); d.v = upload(h.v, dt);
    d.g = upload(h.g, FQ_F32); d.beta = upload(h.beta, FQ_F32); d.dout = upload(h.dout, dt);
    if (c.use_h0) d.h0 = (float *)upload(h.h0, FQ_F32);
    if (c.use_dht) d.dht = (float *)upload(h.dht, FQ_F32);
    const size_t BT = h.BT;
    d.dq = poisoned(BT * c.H * c.K, dt); d.dk = poisoned(BT * c.H * c.K, dt);
    d.dv = poisoned(BT * c.HV * c.V, dt);
    d.dg = poisoned(BT * c.HV, FQ_F32); d.dbeta = poisoned(BT * c.HV, FQ_F32);
    if (c.use_h0) d.dh0 = (float *)poisoned((size_t)h.N * c.HV * c.K * c.V, FQ_F32);
    if (!c.seqlens.empty()) {
        std::vector<int> cu(h.N + 1, 0);
        for (int i = 0; i < h.N; i++) cu[i + 1] = cu[i] + h.lens[i];
        CK(cudaMalloc((void **)&d.cu, cu.size() * 4));
        CK(cudaMemcpy(d.cu, cu.data(), cu.size() * 4, cudaMemcpyHostToDevice));
    }
    p.q = d.q; p.k = d.k; p.v = d.v; p.g = d.g; p.beta = d.beta; p.h0 = d.h0;
    p.cu_seqlens = d.cu; p.cu_seqlens_is_int64 = 0;
    p.dout = d.dout; p.dht = d.dht; p.dq = d.dq; p.dk = d.dk; p.dv = d.dv; p.dg = d.dg;
    p.dbeta = d.dbeta; p.dh0 = d.dh0;
    p.device = 0; p.stream = NULL;
    d.wsb = fq_cuda_chunk_bwd_workspace_bytes(&p);
    CK(cudaMalloc(&d.ws, d.wsb ? d.wsb : 16));
    CK(cudaMemset(d.ws, 0xff, d.wsb ? d.wsb : 16)); /* garbage, not zeros */
    p.workspace = d.ws; p.workspace_bytes = d.wsb;
}

static void release(Dev &d)
{
    void *ptrs[] = {d.q, d.k, d.v, d.g, d.beta, d.dout, d.dq, d.dk, d.dv, d.dg, d.dbeta, d.h0, d.dht, d.dh0, d.cu, d.ws};
    for (void *x : ptrs) if (x) CK(cudaFree(x));
}

static int nfail = 0;

/* summary tables, printed at the end */
struct CaseResult { std::string name; int ok; double worst; };
static std::vector<CaseResult> results;
struct TimeResult {
    char label[64];
    double fla;
    float total, eager, stage[5];
    int same;
};
static std::vector<TimeResult> timings;

static double relerr(const std::vector<double> &a, const std::vector<double> &r, int *nonfinite)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); i++) {
        if (!std::isfinite(a[i])) (*nonfinite)++;
        num += (a[i] - r[i]) * (a[i] - r[i]);
        den += r[i] * r[i];
    }
    return sqrt(num) / (den > 0 ? sqrt(den) : 1.0);
}

static void run_case(const Case &c)
{
    Host h;
    make_inputs(c, h);
    const double scale = 1.0 / sqrt((double)c.K);
    CaseResult res;
    res.name = c.name;
    if (c.dt != FQ_F64) reference(c, h, scale);
    res.ok = 0;
    res.worst = 0;
    do {
        fq_gdn_params p;
        Dev d;
        setup(c, h, p, d, scale);
        fq_status st = fq_cuda_chunk_bwd(&p);
        if (c.dt == FQ_F64) {
            printf("%-34s F64 -> status %d (%s) %s\n", c.name, (int)st, fq_last_error(),
                   st == FQ_ERR_TYPE ? "ok" : "FAIL");
            res.ok = st == FQ_ERR_TYPE;
            if (st != FQ_ERR_TYPE) nfail++;
            release(d);
            break;
        }
        if (st != FQ_OK) {
            printf("%-34s FAIL status %d: %s\n", c.name, (int)st, fq_last_error());
            nfail++;
            release(d);
            break;
        }
        CK(cudaDeviceSynchronize());
        CK(cudaGetLastError());
        const size_t BT = h.BT;
        struct { const char *n; std::vector<double> got, *ref; double tol; } outs[6] = {
            {"dq", download(d.dq, BT * c.H * c.K, c.dt), &h.dq, 1e-2},
            {"dk", download(d.dk, BT * c.H * c.K, c.dt), &h.dk, 1e-2},
            {"dv", download(d.dv, BT * c.HV * c.V, c.dt), &h.dv, 1e-2},
            {"dg", download(d.dg, BT * c.HV, FQ_F32), &h.dg, 2e-2},
            {"dbeta", download(d.dbeta, BT * c.HV, FQ_F32), &h.dbeta, 1e-2},
            {"dh0", c.use_h0 ? download(d.dh0, (size_t)h.N * c.HV * c.K * c.V, FQ_F32) : std::vector<double>(), &h.dh0, 1e-2},
        };
        int ok = 1;
        printf("%-34s", c.name);
        for (int i = 0; i < 6; i++) {
            if (i == 5 && !c.use_h0) continue;
            int nonfin = 0;
            double e = relerr(outs[i].got, *outs[i].ref, &nonfin);
            int pass = nonfin == 0 && e <= outs[i].tol;
            ok &= pass;
            res.worst = std::max(res.worst, nonfin ? INFINITY : e);
            printf(" %s=%.2e%s", outs[i].n, e, nonfin ? "(NaN!)" : (pass ? "" : "(!)"));
        }
        printf("  %s\n", ok ? "ok" : "FAIL");
        fflush(stdout);
        res.ok = ok;
        if (!ok) nfail++;
        release(d);
    } while (0);
    results.push_back(res);
}

/* invalid cu_seqlens (decreasing): every output NaN, nothing out of bounds */
static void run_invalid(void)
{
    Case c = {"invalid cu_seqlens -> NaN", 1, 0, 1, 1, 64, 64, {50, 30, 20}, 0, 1, 1, FQ_BF16, 2};
    Host h;
    make_inputs(c, h);
    CaseResult res;
    res.name = c.name;
    {
        fq_gdn_params p;
        Dev d;
        setup(c, h, p, d, 0.125);
        int bad[4] = {0, 50, 40, 100};
        CK(cudaMemcpy(d.cu, bad, 16, cudaMemcpyHostToDevice));
        CK(cudaMemset(d.dq, 0, (size_t)h.BT * 64 * 2));
        CK(cudaMemset(d.dg, 0, (size_t)h.BT * 4));
        fq_status st = fq_cuda_chunk_bwd(&p);
        CK(cudaDeviceSynchronize());
        std::vector<double> dq = download(d.dq, (size_t)h.BT * 64, FQ_BF16), dg = download(d.dg, h.BT, FQ_F32);
        int allnan = 1;
        for (double x : dq) allnan &= std::isnan(x);
        for (double x : dg) allnan &= std::isnan(x);
        const int ok = st == FQ_OK && allnan;
        printf("%-34s status %d, outputs NaN: %s  %s\n", c.name, (int)st, allnan ? "yes" : "no",
               ok ? "ok" : "FAIL");
        res.ok = ok;
        res.worst = 0;
        if (!ok) nfail++;
        release(d);
    }
    results.push_back(res);
}

/* ------------------------------------------------------------ timing ---- */
static std::vector<uint16_t> raw16(const void *p, size_t n)
{
    std::vector<uint16_t> x(n);
    CK(cudaMemcpy(x.data(), p, n * 2, cudaMemcpyDeviceToHost));
    return x;
}
/* The timing rows' inputs at (B, T, H, HV), K = V = 128, bf16, h0 and dht
 * given, on the device (the host copies freed) */
static void setup_timing(int B, int T, int H, int HV, fq_gdn_params &p, Dev &d)
{
    Case c = {"timing", B, T, H, HV, 128, 128, {}, 0, 1, 1, FQ_BF16, 16};
    Host h;
    make_inputs_fast(c, h);
    setup(c, h, p, d, 1.0 / sqrt(128.0));
}

static void time_case(int B, int T, int H, int HV, double fla_ms)
{
    fq_gdn_params p;
    Dev d;
    setup_timing(B, T, H, HV, p, d);
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    p.stream = s;
    cudaEvent_t e0, e1, ev[7];
    CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    for (int i = 0; i < 7; i++) CK(cudaEventCreate(&ev[i]));
    TimeResult tr;
    memset(&tr, 0, sizeof tr);
    snprintf(tr.label, sizeof tr.label, "%d/%d %dx%d", H, HV, B, T);
    tr.fla = fla_ms;
    const size_t nqk = (size_t)B * T * H * 128;
    auto med = [](std::vector<float> x) { std::sort(x.begin(), x.end()); return x[x.size() / 2]; };
    {
        for (int i = 0; i < 3; i++)
            if (fq_cuda_chunk_bwd(&p) != FQ_OK) { printf("timing: %s\n", fq_last_error()); nfail++; return; }
        CK(cudaStreamSynchronize(s));
        CK(cudaGetLastError());
        std::vector<float> eager, graph, stage[5], sub[3]; /* sub: the recompute's prep (+ stage A v3), fused stage A, state pass (+ W) */
        for (int it = 0; it < 10; it++) {
            CK(cudaEventRecord(e0, s));
            fq_cuda_chunk_bwd(&p);
            CK(cudaEventRecord(e1, s));
            CK(cudaEventSynchronize(e1));
            float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); eager.push_back(ms);
        }
        for (int it = 0; it < 10; it++) {
            CK(cudaEventRecord(e0, s));
            fq_cuda_bwd_run(&p, ev);
            CK(cudaEventSynchronize(ev[4]));
            float prev = 0;
            for (int i = 0; i < 5; i++) {
                float ms; CK(cudaEventElapsedTime(&ms, e0, ev[i])); stage[i].push_back(ms - prev); prev = ms;
            }
            float t5, t6, t0;
            CK(cudaEventElapsedTime(&t5, e0, ev[5]));
            CK(cudaEventElapsedTime(&t6, e0, ev[6]));
            CK(cudaEventElapsedTime(&t0, e0, ev[0]));
            sub[0].push_back(t5);
            sub[1].push_back(t6 - t5);
            sub[2].push_back(t0 - t6);
        }
        /* outputs (eager) */
        std::vector<uint16_t> o_dq = raw16(d.dq, nqk), o_dk = raw16(d.dk, nqk);
        /* CUDA graph: capture one backward, replay; result must equal the eager one */
        cudaGraph_t gr; cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
        fq_status st = fq_cuda_chunk_bwd(&p);
        CK(cudaStreamEndCapture(s, &gr));
        if (st != FQ_OK) { printf("capture failed: %s\n", fq_last_error()); nfail++; return; }
        CK(cudaGraphInstantiate(&ge, gr, 0));
        CK(cudaMemset(d.dq, 0xff, nqk * 2));
        CK(cudaMemset(d.dk, 0xff, nqk * 2));
        CK(cudaGraphLaunch(ge, s));
        CK(cudaStreamSynchronize(s));
        const int same = raw16(d.dq, nqk) == o_dq && raw16(d.dk, nqk) == o_dk;
        if (!same) nfail++;
        for (int it = 0; it < 13; it++) {
            CK(cudaEventRecord(e0, s));
            CK(cudaGraphLaunch(ge, s));
            CK(cudaEventRecord(e1, s));
            CK(cudaEventSynchronize(e1));
            float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
            if (it >= 3) graph.push_back(ms);
        }
        tr.total = med(graph);
        tr.eager = med(eager);
        tr.same = same;
        for (int i = 0; i < 5; i++) tr.stage[i] = med(stage[i]);
        printf("bwd H=%d HV=%d %dx%d K=V=128: graph %.3f ms  eager %.3f ms  (graph == eager: %s)  ws %.2f GB\n",
               H, HV, B, T, tr.total, tr.eager, same ? "yes" : "NO", d.wsb / 1e9);
        printf("     stages: recompute(prep+wy+state) %.3f  local %.3f  state_bwd %.3f  wy_bwd %.3f ms\n",
               tr.stage[0], tr.stage[1], tr.stage[2], tr.stage[3]);
        printf("     recompute: prep (+ stage A v3 off the fused path) %.3f  fused stage A %.3f  state pass (+ W, "
               "gamma from the given A) %.3f ms (events between: serialized)\n", med(sub[0]), med(sub[1]), med(sub[2]));
        fflush(stdout);
        CK(cudaGraphExecDestroy(ge)); CK(cudaGraphDestroy(gr));
    }
    timings.push_back(tr);
    CK(cudaStreamDestroy(s));
    release(d);
}

/* One backward at (B, T, H, HV), K = V = 128, bf16, after one warm-up: for a
 * profiler's per-kernel durations (`check_bwd one B T H HV`, e.g. under
 * ncu --metrics gpu__time_duration.sum -k regex:fq_ --launch-skip <kernels of one
 * backward>). */
static void one_case(int B, int T, int H, int HV)
{
    fq_gdn_params p;
    Dev d;
    setup_timing(B, T, H, HV, p, d);
    for (int i = 0; i < 2; i++)
        if (fq_cuda_chunk_bwd(&p) != FQ_OK) { printf("one: %s\n", fq_last_error()); nfail++; break; }
    CK(cudaDeviceSynchronize());
    printf("one backward %d/%d %dx%d done\n", H, HV, B, T);
#ifdef FQ_REV_TRACE
    rev_trace_print();
#endif
    release(d);
}

static void print_summary(void)
{
    printf("\n================================ summary ================================\n");
    printf("correctness (worst rel. error over dq, dk, dv, dg, dbeta, dh0; limits 1e-2 / dg 2e-2)\n");
    for (auto &r : results) printf("%-36s %s %.1e\n", r.name.c_str(), r.ok ? "ok" : "FAIL", r.worst);
    printf("\ntimes (ms, CUDA-graph replay, median; stages from events: rec = recompute, loc = bwd_local,\n"
           "st = bwd_state, wy = bwd_wy); FLA from ANCHORS.md\n");
    printf("%-16s %6s | %7s %6s %6s %6s %6s %8s %s\n", "shape", "FLA", "total", "rec", "loc", "st", "wy", "FLA/ours",
           "graph==eager");
    for (auto &t : timings)
        printf("%-16s %6.3f | %7.3f %6.3f %6.3f %6.3f %6.3f %8.2f %s\n", t.label, t.fla, t.total, t.stage[0],
               t.stage[1], t.stage[2], t.stage[3], t.fla / t.total, t.same ? "yes" : "NO");
}

int main(int argc, char **argv)
{
    int only_time = 0, small = 0; /* small: five cases (one at K = V = 256), for compute-sanitizer */
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "time")) only_time = 1;
        else if (!strcmp(argv[i], "small")) small = 1;
        else if (!strcmp(argv[i], "one") && i + 4 < argc) {
            one_case(atoi(argv[i + 1]), atoi(argv[i + 2]), atoi(argv[i + 3]), atoi(argv[i + 4]));
            return nfail ? 1 : 0;
        }
    }
    if (!only_time) {
        std::vector<Case> cases = {
            {"T=200 B=2 GVA2 h0 dht", 2, 200, 2, 4, 128, 128, {}, 0, 1, 1, FQ_BF16, 16},
            {"T=200 GVA4 K64 l2 no-h0 no-dht", 1, 200, 1, 4, 64, 64, {}, 1, 0, 0, FQ_BF16, 16},
            {"varlen K128 GVA1 l2 h0 dht", 1, 0, 2, 2, 128, 128, {1, 63, 64, 65, 300, 0}, 1, 1, 1, FQ_BF16, 16},
            {"varlen K64 GVA2 dht", 1, 0, 1, 2, 64, 64, {0, 1, 63, 64, 65, 300}, 0, 0, 1, FQ_BF16, 16},
            /* K = V = 256 (issue 7 item 4): h in 64-row slices in bwd_local, bwd_state ks 2 with a
             * 2-deep ring, 1 block per SM for bwd_wy and the recompute; the first in `small` too */
            {"varlen K256 GVA2 l2 h0 dht", 1, 0, 1, 2, 256, 256, {1, 63, 64, 65, 37}, 1, 1, 1, FQ_BF16, 16},
            {"T=300 B=2 K256 fp32 GVA2 h0 dht", 2, 300, 2, 4, 256, 256, {}, 0, 1, 1, FQ_F32, 16},
            {"T=1000 K256 HV=2 A=0,16 h0 dht", 1, 1000, 1, 2, 256, 256, {}, 0, 1, 1, FQ_BF16, 16},
            {"T=130 fp16 GVA2 l2 h0", 1, 130, 1, 2, 128, 128, {}, 1, 1, 0, FQ_F16, 8},
            {"T=130 fp32 in K128 V64 h0", 1, 130, 1, 1, 128, 64, {}, 0, 1, 1, FQ_F32, 4},
            {"T=130 K64 V128 GVA2 l2 h0", 1, 130, 1, 2, 64, 128, {}, 1, 1, 1, FQ_BF16, 16},
            {"float64 refused", 1, 10, 1, 1, 64, 64, {}, 0, 0, 0, FQ_F64, 1},
            {"T=8192 HV=2 A=0,16 h0 dht", 1, 8192, 1, 2, 128, 128, {}, 0, 1, 1, FQ_BF16, 16},
            {"T=8192 HV=1 A=2 l2 h0", 1, 8192, 1, 1, 128, 128, {}, 1, 1, 0, FQ_BF16, 2},
        };
        for (size_t i = 0; i < (small ? 5 : cases.size()); i++) run_case(cases[i]);
        run_invalid();
    }
    if (!small) {
        /* the backward rows of ANCHORS.md */
        time_case(1, 8192, 16, 32, 1.483);
        time_case(1, 32768, 16, 32, 5.853);
        time_case(8, 4096, 16, 32, 5.901);
        time_case(1, 32768, 4, 8, 2.735);
        time_case(1, 32768, 2, 4, 2.295);
    }
    print_summary();
    printf("%s (%d failures)\n", nfail ? "FAILED" : "ALL OK", nfail);
    return nfail ? 1 : 0;
}
