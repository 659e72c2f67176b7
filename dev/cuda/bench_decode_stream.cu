/*
 * dev/cuda/bench_decode_stream.cu — what the decode step's memory traffic can
 * reach on this GPU, without the decode's arithmetic (issue 11 item 6).
 *
 * The decode step reads a state pool [N, HV, 128, 128] fp32 once and writes it
 * back in place; every thread must have all of its state before it stores any
 * (the reduction over K). Each variant here does exactly that traffic
 * (S <- 0.999 S + 1e-30 sum(S of the thread), in place) with one way of
 * splitting the pool:
 *
 *   kvw4   blocks of 4 warps, a warp 8 columns x 128 rows of a [K, V] head
 *          (the recurrent kernel's lane map: 16 rows x 32 bytes per float4
 *          instruction), loads straight into registers
 *   kvw2   the same with blocks of 2 warps
 *   c4     a warp per 4 KB contiguous run (8 float4 per lane)
 *   c16    a block of 128 threads per 16 KB contiguous run
 *   c64a   a block of 256 threads per 64 KB head (16 float4 per thread)
 *   c64b   a block of 512 threads per 64 KB head (8 float4 per thread)
 *   blk16 / blk32  persistent blocks of 128 threads, stages of 16 / 32 KB
 *          filled by cp.async.bulk (one mbarrier each, 4 stages), read into
 *          registers, written back to the stage and stored by a bulk copy
 *   copy   float4 grid-stride copy between two buffers (the ceiling)
 *   memcpy cudaMemcpyAsync device to device
 *
 * Rows: N = 16, 64, 256 sequences x 32 heads (events, median of 30), TB/s of
 * read + write; then N = 16 and 64 with pools in turn (32 launches in a graph
 * over pools that exceed the L2, as a model's layers); then N = 1 (2 MB) as 100 launches in one CUDA graph, with and
 * without programmatic dependent launch, microseconds per launch.
 *
 *   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -I csrc -I csrc/cuda -I dev/cuda \
 *        dev/cuda/bench_decode_stream.cu -o /tmp/bench_decode_stream -lcuda
 */
#include "check_common.h"
#include "gdn_cuda_hopper.cuh"

#include <algorithm>
#include <stdio.h>
#include <vector>


static __device__ __forceinline__ float4 fx(float4 x, float s)
{
    return make_float4(0.999f * x.x + s, 0.999f * x.y + s, 0.999f * x.z + s, 0.999f * x.w + s);
}
static __device__ __forceinline__ float hsum(float4 x) { return x.x + x.y + x.z + x.w; }

/* kvw: warp item = (head, 8 columns); lane rg = lane & 15, cg = lane >> 4;
 * float4 f: row 64 (f / 4) + 4 rg + f % 4, columns c0 = 8 w + 4 cg */
__global__ void k_kvw(float *pool, int nwarps_per_block)
{
    fq_pdl_wait();
    const int lane = threadIdx.x & 31, w = blockIdx.x * nwarps_per_block + (threadIdx.x >> 5);
    const int head = w >> 4, grp = w & 15;
    float *base = pool + (size_t)head * 16384 + 4 * (lane & 15) * 128 + 8 * grp + 4 * (lane >> 4);
    float4 s[8];
    float acc = 0.f;
#pragma unroll
    for (int f = 0; f < 8; f++) s[f] = *(const float4 *)(base + (64 * (f / 4) + (f % 4)) * 128);
#pragma unroll
    for (int f = 0; f < 8; f++) acc += hsum(s[f]);
    acc *= 1e-30f;
#pragma unroll
    for (int f = 0; f < 8; f++) *(float4 *)(base + (64 * (f / 4) + (f % 4)) * 128) = fx(s[f], acc);
}

/* contiguous runs: block b owns float4 [b * NT * PER, (b + 1) * NT * PER) */
template <int NT, int PER> __global__ void __launch_bounds__(NT) k_contig(float *pool)
{
    fq_pdl_wait();
    float4 *base = (float4 *)pool + (size_t)blockIdx.x * NT * PER + threadIdx.x;
    float4 s[PER];
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < PER; i++) s[i] = base[NT * i];
#pragma unroll
    for (int i = 0; i < PER; i++) acc += hsum(s[i]);
    acc *= 1e-30f;
#pragma unroll
    for (int i = 0; i < PER; i++) base[NT * i] = fx(s[i], acc);
}

/* persistent, 128 threads, NS stages of SB bytes: thread 0 the producer */
template <int SB, int NS> __global__ void __launch_bounds__(128) k_bulk(float *pool, int items)
{
    extern __shared__ __align__(128) unsigned char sm[];
    __shared__ uint64_t full[NS];
    fq_pdl_wait();
    const int tid = threadIdx.x;
    if (tid == 0) {
        for (int s = 0; s < NS; s++) fq_mbar_init(&full[s], 1);
        fq_mbar_init_fence();
    }
    __syncthreads();
    const int G = gridDim.x;
    int it0 = blockIdx.x;
    /* prologue: NS - 1 stages in flight */
    if (tid == 0)
        for (int s = 0; s < NS - 1; s++) {
            const int it = it0 + s * G;
            if (it < items) {
                fq_mbar_arrive_tx(&full[s], SB);
                fq_bulk_load(sm + s * SB, (const unsigned char *)pool + (size_t)it * SB, SB, &full[s]);
            }
        }
    int k = 0;
    for (int it = it0; it < items; it += G, k++) {
        const int s = k % NS;
        /* the stage NS - 1 items ahead: free once its store has read it */
        if (tid == 0) {
            const int nit = it + (NS - 1) * G, ns = (k + NS - 1) % NS;
            fq_bulk_wait_read<0>(); /* (conservative: every earlier store has read its stage) */
            if (nit < items) {
                fq_mbar_arrive_tx(&full[ns], SB);
                fq_bulk_load(sm + ns * SB, (const unsigned char *)pool + (size_t)nit * SB, SB, &full[ns]);
            }
        }
        fq_mbar_wait(&full[s], (k / NS) & 1);
        float4 *st = (float4 *)(sm + s * SB);
        constexpr int PER = SB / 16 / 128;
        float4 x[PER];
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < PER; i++) x[i] = st[tid + 128 * i];
#pragma unroll
        for (int i = 0; i < PER; i++) acc += hsum(x[i]);
        acc *= 1e-30f;
#pragma unroll
        for (int i = 0; i < PER; i++) st[tid + 128 * i] = fx(x[i], acc);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        if (tid == 0) {
            asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(
                             (unsigned char *)pool + (size_t)it * SB),
                         "r"(fq_smem_u32(st)), "r"(SB)
                         : "memory");
            fq_bulk_commit();
        }
    }
    if (tid == 0) fq_bulk_wait0();
}

/* kvs: a block of 128 threads per (head, 32-column slice); thread t holds
 * columns 4 (t % 8) .. + 3 of rows t / 8 + 16 i: each warp instruction reads
 * 4 rows x 128 contiguous bytes */
__global__ void __launch_bounds__(128) k_kvs(float *pool)
{
    fq_pdl_wait();
    const int head = blockIdx.x >> 2, sl = blockIdx.x & 3, t = threadIdx.x;
    float *base = pool + (size_t)head * 16384 + (t >> 3) * 128 + 32 * sl + 4 * (t & 7);
    float4 s[8];
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i++) s[i] = *(const float4 *)(base + 16 * 128 * i);
#pragma unroll
    for (int i = 0; i < 8; i++) acc += hsum(s[i]);
    acc *= 1e-30f;
#pragma unroll
    for (int i = 0; i < 8; i++) *(float4 *)(base + 16 * 128 * i) = fx(s[i], acc);
}

/* cl4: a cluster of 4 blocks of 128 threads per head, block r of it the 16 KB
 * contiguous rows 32 r .. 32 r + 31; column partial sums over the block's rows
 * (shared memory), exchanged through distributed shared memory (each block
 * adds the other three's), then the store: the kv decode's cross-row reduction
 * with contiguous loads */
__global__ void __cluster_dims__(4, 1, 1) __launch_bounds__(128) k_cl4(float *pool)
{
    __shared__ float4 part[4][32]; /* [warp][column float4] */
    __shared__ float4 tot[32];
    fq_pdl_wait();
    const int head = blockIdx.x >> 2, r = blockIdx.x & 3, t = threadIdx.x, w = t >> 5, l = t & 31;
    /* thread: columns 4 l .., rows 32 r + w + 4 i */
    float4 *base = (float4 *)(pool + (size_t)head * 16384 + (32 * r + w) * 128) + l;
    float4 s[8];
#pragma unroll
    for (int i = 0; i < 8; i++) s[i] = base[4 * 32 * i];
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int i = 0; i < 8; i++) a.x += s[i].x, a.y += s[i].y, a.z += s[i].z, a.w += s[i].w;
    part[w][l] = a;
    __syncthreads();
    if (t < 32) {
        float4 b = part[0][t];
        for (int q = 1; q < 4; q++) b.x += part[q][t].x, b.y += part[q][t].y, b.z += part[q][t].z, b.w += part[q][t].w;
        tot[t] = b;
    }
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
    float4 c = tot[l];
#pragma unroll
    for (int q = 1; q < 4; q++) {
        const uint32_t peer = (r + q) & 3;
        uint32_t addr;
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(addr) : "r"(fq_smem_u32(&tot[l])), "r"(peer));
        float4 x;
        asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                     : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w) : "r"(addr) : "memory");
        c.x += x.x, c.y += x.y, c.z += x.z, c.w += x.w;
    }
    /* no block may leave while a peer still reads its shared memory */
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
    const float acc = 1e-30f * (c.x + c.y + c.z + c.w);
#pragma unroll
    for (int i = 0; i < 8; i++) base[4 * 32 * i] = fx(s[i], acc);
}

__global__ void k_copy(const float4 *a, float4 *b, size_t n)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) b[i] = a[i];
}

struct Var {
    const char *name;
    int kind; /* 0 kvw, 1 contig, 2 bulk */
    int arg;
    int cap; /* > 0: at most cap blocks per SM (dynamic shared memory as the limit), as the real kernel's registers */
};

static int g_sms;

static void launch(const Var &v, float *pool, size_t heads, cudaStream_t s, int pdl)
{
    cudaLaunchConfig_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = pdl ? 1 : 0;
    cfg.stream = s;
    const size_t bytes = heads * 65536;
    if (v.cap > 0) cfg.dynamicSmemBytes = (size_t)(225 * 1024 / v.cap) - 1024;
    if (v.kind == 3) {
        cfg.gridDim = dim3((unsigned)(heads * 4)); cfg.blockDim = dim3(128);
        CK(cudaLaunchKernelEx(&cfg, v.arg ? k_cl4 : k_kvs, pool));
    } else if (v.kind == 0) {
        cfg.gridDim = dim3((unsigned)(heads * 16 / v.arg));
        cfg.blockDim = dim3(32 * v.arg);
        CK(cudaLaunchKernelEx(&cfg, k_kvw, pool, v.arg));
    } else if (v.kind == 1) {
        if (v.arg == 4) {
            cfg.gridDim = dim3((unsigned)(bytes / 4096)); cfg.blockDim = dim3(32);
            CK(cudaLaunchKernelEx(&cfg, k_contig<32, 8>, pool));
        } else if (v.arg == 16) {
            cfg.gridDim = dim3((unsigned)(bytes / 16384)); cfg.blockDim = dim3(128);
            CK(cudaLaunchKernelEx(&cfg, k_contig<128, 8>, pool));
        } else if (v.arg == 64) {
            cfg.gridDim = dim3((unsigned)(bytes / 65536)); cfg.blockDim = dim3(256);
            CK(cudaLaunchKernelEx(&cfg, k_contig<256, 16>, pool));
        } else {
            cfg.gridDim = dim3((unsigned)(bytes / 65536)); cfg.blockDim = dim3(512);
            CK(cudaLaunchKernelEx(&cfg, k_contig<512, 8>, pool));
        }
    } else {
        const int SB = v.arg * 1024;
        const int items = (int)(bytes / SB);
        const int per_sm = SB == 16384 ? 3 : 1;
        int grid = std::min(items, per_sm * g_sms);
        cfg.gridDim = dim3(grid); cfg.blockDim = dim3(128);
        cfg.dynamicSmemBytes = 4 * SB;
        if (SB == 16384) CK(cudaLaunchKernelEx(&cfg, k_bulk<16384, 4>, pool, items));
        else CK(cudaLaunchKernelEx(&cfg, k_bulk<32768, 4>, pool, items));
    }
}

static float med(std::vector<float> x)
{
    std::sort(x.begin(), x.end());
    return x[x.size() / 2];
}

int main()
{
    CK(cudaDeviceGetAttribute(&g_sms, cudaDevAttrMultiProcessorCount, 0));
    cudaDeviceProp pr;
    CK(cudaGetDeviceProperties(&pr, 0));
    printf("%s, %d SMs\n", pr.name, g_sms);
    CK(cudaFuncSetAttribute(k_bulk<16384, 4>, cudaFuncAttributeMaxDynamicSharedMemorySize, 4 * 16384));
    CK(cudaFuncSetAttribute(k_bulk<32768, 4>, cudaFuncAttributeMaxDynamicSharedMemorySize, 4 * 32768));
    const Var vars[] = {{"kvw4", 0, 4, 0},   {"kvw4/5", 0, 4, 5}, {"kvw2", 0, 2, 0},  {"c4", 1, 4, 0},
                        {"c16", 1, 16, 0},   {"c16/5", 1, 16, 5}, {"c64a", 1, 64, 0}, {"c64a/2", 1, 64, 2},
                        {"c64b", 1, 65, 0},  {"blk16", 2, 16, 0}, {"blk32", 2, 32, 0},
                        {"kvs", 3, 0, 0},    {"cl4", 3, 1, 0}};
    {
        const void *ks[] = {(const void *)k_kvw, (const void *)k_contig<32, 8>, (const void *)k_contig<128, 8>,
                            (const void *)k_contig<256, 16>, (const void *)k_contig<512, 8>,
                            (const void *)k_kvs, (const void *)k_cl4};
        for (const void *k : ks) CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    }
    const size_t maxheads = 256 * 32;
    float *pool, *pool2;
    CK(cudaMalloc(&pool, maxheads * 65536));
    CK(cudaMalloc(&pool2, maxheads * 65536));
    CK(cudaMemset(pool, 0, maxheads * 65536));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    const int Ns[] = {16, 64, 256};
    printf("%-8s", "N x 32");
    for (int N : Ns) printf(" | %8d us   TB/s", N);
    printf("\n");
    auto timeit = [&](auto fn) {
        for (int i = 0; i < 3; i++) fn();
        std::vector<float> t;
        for (int i = 0; i < 30; i++) {
            CK(cudaEventRecord(e0, s)); fn(); CK(cudaEventRecord(e1, s)); CK(cudaEventSynchronize(e1));
            float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); t.push_back(ms);
        }
        return med(t);
    };
    for (const Var &v : vars) {
        printf("%-8s", v.name);
        for (int N : Ns) {
            const size_t heads = (size_t)N * 32;
            float ms = timeit([&] { launch(v, pool, heads, s, 0); });
            printf(" | %11.2f %6.3f", ms * 1e3, 2.0 * heads * 65536 / (ms * 1e-3) / 1e12);
        }
        printf("\n");
    }
    printf("%-8s", "copy");
    for (int N : Ns) {
        const size_t heads = (size_t)N * 32, n4 = heads * 65536 / 16;
        float ms = timeit([&] { k_copy<<<4 * g_sms, 512, 0, s>>>((const float4 *)pool, (float4 *)pool2, n4); });
        printf(" | %11.2f %6.3f", ms * 1e3, 2.0 * heads * 65536 / (ms * 1e-3) / 1e12);
    }
    printf("\n%-8s", "memcpy");
    for (int N : Ns) {
        const size_t heads = (size_t)N * 32;
        float ms = timeit([&] { CK(cudaMemcpyAsync(pool2, pool, heads * 65536, cudaMemcpyDeviceToDevice, s)); });
        printf(" | %11.2f %6.3f", ms * 1e3, 2.0 * heads * 65536 / (ms * 1e-3) / 1e12);
    }
    /* ms per launch of n launches captured in one graph (enqueue(i): launch i) */
    auto graph_ms = [&](int n, auto enqueue) {
        cudaGraph_t g;
        cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < n; i++) enqueue(i);
        CK(cudaStreamEndCapture(s, &g));
        CK(cudaGraphInstantiate(&ge, g, 0));
        const float ms = timeit([&] { CK(cudaGraphLaunch(ge, s)); }) / n;
        CK(cudaGraphExecDestroy(ge)); CK(cudaGraphDestroy(g));
        return ms;
    };
    /* pools in turn: a graph of 32 launches, launch i on pool i % P of P pools that
     * together exceed the 50 MB L2 (as consecutive layers' pools), so that every
     * launch streams from DRAM; programmatic dependent launch as the library's */
    printf("\n\npools in turn (graph of 32 launches over 8 pools at N = 16, 4 at N = 64), us per launch, TB/s\n");
    for (const Var &v : vars) {
        if (v.kind == 2 || v.cap > 0) continue;
        printf("%-8s", v.name);
        for (int N : {16, 64}) {
            const size_t heads = (size_t)N * 32, P = N == 16 ? 8 : 4;
            const float ms = graph_ms(32, [&](int i) { launch(v, pool + (size_t)(i % P) * heads * 16384, heads, s, i > 0); });
            printf(" | N=%-3d %8.2f %6.3f", N, ms * 1e3, 2.0 * heads * 65536 / (ms * 1e-3) / 1e12);
        }
        printf("\n");
    }
    printf("%-8s", "copy");
    for (int N : {16, 64}) {
        const size_t heads = (size_t)N * 32, n4 = heads * 65536 / 16, P = N == 16 ? 8 : 4;
        const float ms = graph_ms(32, [&](int i) {
            const size_t o = (size_t)(i % P) * heads * 16384;
            k_copy<<<4 * g_sms, 512, 0, s>>>((const float4 *)(pool + o), (float4 *)(pool2 + o), n4);
        });
        printf(" | N=%-3d %8.2f %6.3f", N, ms * 1e3, 2.0 * heads * 65536 / (ms * 1e-3) / 1e12);
    }
    printf("\n\nN = 1 (32 heads, 2 MB): 100 launches in one graph, us per launch\n");
    for (const Var &v : vars) {
        printf("%-8s", v.name);
        for (int pdl = 0; pdl < 2; pdl++) {
            const float ms = graph_ms(100, [&](int i) { launch(v, pool + (size_t)(i % 8) * 32 * 16384, 32, s, pdl && i > 0); });
            printf("  %s %.3f", pdl ? "pdl" : "plain", ms * 1e3);
        }
        printf("\n");
    }
    CK(cudaStreamSynchronize(s));
    printf("done\n");
    return 0;
}
