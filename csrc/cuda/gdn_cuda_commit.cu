/*
 * gdn_cuda_commit.cu — the commit of a speculative-verify step (gdn.h,
 * fq_cuda_commit): after gdn_recurrent(..., intermediate_states=buf,
 * update_state=False), for every sequence n with slot = state_indices[n] >= 0
 * and a = num_accepted[n] > 0:
 *
 *     pool[slot] = buf[n, a - 1]        (HV * K * V floats; both buffers share
 *                                         one layout, so this is a copy)
 *
 * One grid of blocks per sequence copying 16-byte words; no host
 * synchronisation, so verify + commit can be captured in a CUDA graph.
 * Entries that cannot be checked from the host without a synchronisation
 * (slot >= P, a > Ti or a < 0) leave the slot untouched (FLASHQLA_CHECK_INPUTS=1
 * raises them, and duplicate slots, as ValueError; a duplicate slot left in
 * belongs to its first sequence, as in the recurrent step).
 */
#include "gdn_cuda_common.cuh"

static __device__ __forceinline__ int64_t fq_commit_index(const void *p, int is64, int64_t i)
{
    return is64 ? ((const int64_t *)p)[i] : (int64_t)((const int32_t *)p)[i];
}

__global__ void fq_commit_kernel(float4 *pool, const float4 *inter, const void *idx, int idx64, const void *acc,
                                 int acc64, int64_t P, int64_t Ti, int64_t per4, int bps)
{
    const int64_t n = blockIdx.x / bps;
    const int part = blockIdx.x % bps;
    const int64_t slot = idx ? fq_commit_index(idx, idx64, n) : n;
    const int64_t a = fq_commit_index(acc, acc64, n);
    if (slot < 0 || slot >= P || a <= 0 || a > Ti) return;
    /* a slot an earlier sequence names too belongs to that one (as in the
     * recurrent step): no race between two copies into one slot */
    int dup = 0;
    if (idx)
        for (int64_t m = threadIdx.x; m < n && !dup; m += blockDim.x) dup = fq_commit_index(idx, idx64, m) == slot;
    if (__syncthreads_or(dup)) return;
    const float4 *src = inter + (n * Ti + a - 1) * per4;
    float4 *dst = pool + slot * per4;
    for (int64_t i = (int64_t)part * blockDim.x + threadIdx.x; i < per4; i += (int64_t)bps * blockDim.x)
        dst[i] = src[i];
}

static fq_status fq_commit_on_device(const fq_gdn_params *p)
{
    const int64_t per4 = p->HV * p->K * p->V / 4;
    if (p->N <= 0 || per4 <= 0) return FQ_OK;
    /* ~8 float4 per thread, at most 64 blocks per sequence */
    int64_t bps = (per4 + 256 * 8 - 1) / (256 * 8);
    if (bps > 64) bps = 64;
    const int64_t blocks = p->N * bps;
    if (blocks > 0x7fffffff)
        return fq_fail(FQ_ERR_VALUE, "state_indices: too many sequences for one commit (N=%lld)", (long long)p->N);
    fq_commit_kernel<<<(unsigned)blocks, 256, 0, (cudaStream_t)p->stream>>>(
        (float4 *)p->state, (const float4 *)p->intermediate_states, p->state_indices, p->state_indices_is_int64,
        p->num_accepted, p->num_accepted_is_int64, p->P, p->Ti, per4, (int)bps);
    FQ_CUDA_CHECK_LAUNCH();
    return FQ_OK;
}

extern "C" fq_status fq_cuda_commit(const fq_gdn_params *p)
{
    fq_status st = fq_check_params_device(p, 'c');
    if (st != FQ_OK) return st;
    if ((st = fq_cuda_check_contents(p, 'c')) != FQ_OK) return st; /* FLASHQLA_CHECK_INPUTS=1 */
    if (p->state_dtype != FQ_F32)
        return fq_fail(FQ_ERR_TYPE, "state: the CUDA backend keeps states in float32, got %s",
                       fq_dtype_name(p->state_dtype));
    if ((p->HV * p->K * p->V) % 4 != 0 || (((uintptr_t)p->state | (uintptr_t)p->intermediate_states) & 15))
        return fq_fail(FQ_ERR_VALUE, "state, intermediate_states: CUDA commit needs 16-byte aligned buffers "
                                     "and HV * K * V a multiple of 4");
    return fq_cuda_on_device(p, fq_commit_on_device);
}
