/*
 * gdn_cuda_gates.cu — fused gates for the CUDA chunk forward and backward
 * (FLA 0.6.0's use_gate_in_kernel / use_beta_sigmoid_in_kernel), as small
 * kernels around whichever chunk kernels run, so that those see ordinary
 * float32 gates:
 *
 *   pre-pass  (forward and backward), per element e = token * HV + j:
 *       g[e]    = -exp(A_log[j]) * softplus(a[e] + dt_bias[j])  (use_gate_in_kernel; else a[e])
 *       beta[e] = sigmoid(b[e])                                  (use_beta_sigmoid_in_kernel; else b[e])
 *     into float32 arrays at the start of the caller's workspace;
 *   post-pass (backward), from the chunk backward's float32 dg, dbeta:
 *       fwd: g = -exp(A_log) softplus(x), x = a + dt_bias
 *         ->  da = dg * (-exp(A_log) sigmoid(x)),  ddt_bias = sum da,  dA_log = sum dg * g
 *       fwd: beta = sigmoid(b)  ->  db = dbeta * beta (1 - beta)
 *     da, db into the caller's dg, dbeta (the gradients of what was passed
 *     as g and beta). The sums over tokens are deterministic: slabs of 64
 *     tokens, each summed by one thread in token order (in double), then the
 *     slabs in order by one thread per head; no atomics.
 *
 * The gate region (fq_cuda_gates_ws_bytes) is reserved at the start of the
 * chunk workspace only when a call fuses a gate: the workspace size depends on
 * the sizes and the two gate flags (flashqla._C.workspace_bytes takes them).
 */
#include "gdn_cuda_common.cuh"

#define FQ_GATE_SLAB 64 /* tokens per partial sum of the post-pass */

static size_t fq_gates_align(size_t x) { return (x + 255) & ~(size_t)255; }

static int64_t fq_gates_slabs(const fq_gdn_params *p) { return (p->B * p->T + FQ_GATE_SLAB - 1) / FQ_GATE_SLAB; }

/* Bytes of the gate region: g, beta (forward); g, beta, dg, dbeta and the
 * partial sums [slabs][HV][2] (backward). */
extern "C" size_t fq_cuda_gates_ws_bytes(const fq_gdn_params *p, char op)
{
    if (!p->use_gate_in_kernel && !p->use_beta_sigmoid_in_kernel) return 0;
    const size_t e = (size_t)(p->B * p->T * p->HV) * 4;
    if (op == 'f') return 2 * fq_gates_align(e);
    return 4 * fq_gates_align(e) + fq_gates_align((size_t)(fq_gates_slabs(p) * p->HV) * 2 * sizeof(double));
}

static __device__ __forceinline__ float fq_softplus(float x) { return x > 20.f ? x : log1pf(__expf(x)); }
static __device__ __forceinline__ float fq_sigmoid(float x) { return 1.f / (1.f + __expf(-x)); }

__global__ void fq_gates_fwd_kernel(const void *g, const void *beta, fq_dtype gdt, const float *A_log,
                                    const float *dt_bias, int use_gate, int use_sig, int HV, int64_t n,
                                    float *gout, float *bout)
{
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
        const int j = (int)(e % HV);
        const float a = fq_ld_f(g, gdt, e), b = fq_ld_f(beta, gdt, e);
        gout[e] = use_gate ? -__expf(A_log[j]) * fq_softplus(a + (dt_bias ? dt_bias[j] : 0.f)) : a;
        bout[e] = use_sig ? fq_sigmoid(b) : b;
    }
}

/* Thread (head j, slab s = blockIdx.x): the elementwise chain rule for the slab's tokens
 * of head j, and the slab's sums of dg * g and da (token order). Threads of
 * a warp take consecutive heads, so every load and store is coalesced. */
__global__ void fq_gates_bwd_slab_kernel(const void *a_raw, fq_dtype gdt, const float *g, const float *beta,
                                         const float *dg, const float *dbeta, const float *A_log,
                                         const float *dt_bias, int use_gate, int use_sig, int HV, int64_t tokens,
                                         void *da_out, void *db_out, double *part)
{
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    const int64_t s = blockIdx.x;
    if (j >= HV) return;
    const float Aexp = use_gate ? __expf(A_log[j]) : 0.f, dtb = use_gate && dt_bias ? dt_bias[j] : 0.f;
    double sum_dA = 0, sum_ddt = 0;
    const int64_t t1 = min((s + 1) * FQ_GATE_SLAB, tokens);
    for (int64_t t = s * FQ_GATE_SLAB; t < t1; t++) {
        const int64_t e = t * HV + j;
        float d = dg[e];
        if (use_gate) {
            const float x = fq_ld_f(a_raw, gdt, e) + dtb;
            const float da = d * (-Aexp * fq_sigmoid(x));
            sum_dA += (double)d * (double)g[e];
            sum_ddt += (double)da;
            d = da;
        }
        fq_st_f(da_out, gdt, e, d);
        float db = dbeta[e];
        if (use_sig) db *= beta[e] * (1.f - beta[e]);
        fq_st_f(db_out, gdt, e, db);
    }
    if (use_gate) {
        part[(s * HV + j) * 2] = sum_dA;
        part[(s * HV + j) * 2 + 1] = sum_ddt;
    }
}

/* dA_log[j], ddt_bias[j] = the slabs' sums in slab order. */
__global__ void fq_gates_bwd_sum_kernel(const double *part, int64_t slabs, int HV, float *dA_log, float *ddt_bias)
{
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= HV) return;
    double a = 0, b = 0;
    for (int64_t s = 0; s < slabs; s++) {
        a += part[(s * HV + j) * 2];
        b += part[(s * HV + j) * 2 + 1];
    }
    if (dA_log) dA_log[j] = (float)a;
    if (ddt_bias) ddt_bias[j] = (float)b;
}

/* The params the chunk kernels see: the workspace past the gate region and,
 * with fused gates, the pre-passed float32 g, beta (op 'b': also float32
 * dg, dbeta in the region). `out` starts as a copy of `p`. */
extern "C" fq_status fq_cuda_gates_begin(const fq_gdn_params *p, char op, fq_gdn_params *out, cudaStream_t stream)
{
    *out = *p;
    const size_t region = fq_cuda_gates_ws_bytes(p, op);
    fq_status st = fq_cuda_check_workspace(p, region);
    if (st != FQ_OK) return st;
    out->workspace = (char *)p->workspace + region;
    out->workspace_bytes = p->workspace_bytes - region;
    if (!p->use_gate_in_kernel && !p->use_beta_sigmoid_in_kernel) return FQ_OK;

    const int64_t n = p->B * p->T * p->HV;
    const size_t e = fq_gates_align((size_t)n * 4);
    char *base = (char *)p->workspace;
    float *g = (float *)base, *beta = (float *)(base + e);
    if (n > 0) {
        int64_t blocks = (n + 255) / 256;
        if (blocks > 4096) blocks = 4096;
        fq_gates_fwd_kernel<<<(unsigned)blocks, 256, 0, stream>>>(p->g, p->beta, p->gate_dtype,
                                                                  (const float *)p->A_log,
                                                                  (const float *)p->dt_bias, p->use_gate_in_kernel,
                                                                  p->use_beta_sigmoid_in_kernel, (int)p->HV, n, g,
                                                                  beta);
        FQ_CUDA_CHECK_LAUNCH();
    }
    out->g = g;
    out->beta = beta;
    out->gate_dtype = FQ_F32;
    out->use_gate_in_kernel = 0;
    out->use_beta_sigmoid_in_kernel = 0;
    out->A_log = out->dt_bias = NULL;
    out->dA_log = out->ddt_bias = NULL;
    if (op == 'b') {
        out->dg = base + 2 * e;
        out->dbeta = base + 3 * e;
    }
    return FQ_OK;
}

/* After the chunk backward ran with `q` from fq_cuda_gates_begin(p, 'b', q):
 * da, db into p->dg, p->dbeta and the sums into p->dA_log, p->ddt_bias. */
extern "C" fq_status fq_cuda_gates_end(const fq_gdn_params *p, const fq_gdn_params *q, cudaStream_t stream)
{
    if (!p->use_gate_in_kernel && !p->use_beta_sigmoid_in_kernel) return FQ_OK;
    const int64_t tokens = p->B * p->T, slabs = fq_gates_slabs(p);
    const size_t e = fq_gates_align((size_t)(tokens * p->HV) * 4);
    double *part = (double *)((char *)p->workspace + 4 * e);
    const int HV = (int)p->HV, th = HV < 128 ? (HV + 31) / 32 * 32 : 128;
    if (slabs > 0) {
        dim3 grid((unsigned)slabs, (unsigned)((HV + th - 1) / th)); /* slabs in x: no 65535 limit */
        fq_gates_bwd_slab_kernel<<<grid, th, 0, stream>>>(p->g, p->gate_dtype, (const float *)q->g,
                                                          (const float *)q->beta, (const float *)q->dg,
                                                          (const float *)q->dbeta, (const float *)p->A_log,
                                                          (const float *)p->dt_bias, p->use_gate_in_kernel,
                                                          p->use_beta_sigmoid_in_kernel, HV, tokens, p->dg,
                                                          p->dbeta, part);
        FQ_CUDA_CHECK_LAUNCH();
    }
    if (p->use_gate_in_kernel && (p->dA_log || p->ddt_bias)) {
        if (slabs == 0) { /* no tokens: zero sums */
            if (p->dA_log) FQ_CUDA_CHECK(cudaMemsetAsync(p->dA_log, 0, (size_t)HV * 4, stream));
            if (p->ddt_bias) FQ_CUDA_CHECK(cudaMemsetAsync(p->ddt_bias, 0, (size_t)HV * 4, stream));
            return FQ_OK;
        }
        fq_gates_bwd_sum_kernel<<<(unsigned)((HV + th - 1) / th), th, 0, stream>>>(
            part, slabs, HV, (float *)p->dA_log, (float *)p->ddt_bias);
        FQ_CUDA_CHECK_LAUNCH();
    }
    return FQ_OK;
}
