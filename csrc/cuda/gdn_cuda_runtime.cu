/*
 * gdn_cuda_runtime.cu — the small CUDA runtime helpers of gdn.h that the
 * binding needs (module.c includes no CUDA header): whether CUDA was built,
 * device memory for buffers handed out through DLPack, and a wait on a
 * stream. Each helper makes `device` current for its call and restores the
 * caller's current device afterwards, so a framework's own notion of the
 * current device (PyTorch, CuPy) is left as it was.
 */
#include <cuda_runtime.h>

#include "gdn.h"

#include <stdlib.h>

/* Makes `device` current; remembers the previous one in *prev. */
static fq_status fq_cuda_enter_device(int device, int *prev, const char *what)
{
    cudaError_t err = cudaGetDevice(prev);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        return fq_fail(FQ_ERR_CUDA, "%s: cudaGetDevice failed: %s", what,
                       cudaGetErrorString(err));
    }
    if (*prev == device) return FQ_OK;
    err = cudaSetDevice(device);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        return fq_fail(FQ_ERR_CUDA, "%s: cudaSetDevice(%d) failed: %s", what, device,
                       cudaGetErrorString(err));
    }
    return FQ_OK;
}

static void fq_cuda_leave_device(int device, int prev)
{
    if (prev != device) (void)cudaSetDevice(prev);
}

extern "C" int fq_cuda_built(void) { return 1; }

/* ------------------------------------------- FLASHQLA_CHECK_INPUTS=1 ---- */

/* Copies `bytes` of device memory to a new host buffer on p->stream (*out
 * NULL when src is NULL or bytes is 0). */
static fq_status fq_cuda_copy_to_host(const fq_gdn_params *p, const void *src, size_t bytes,
                                      void **out)
{
    *out = NULL;
    if (!src || bytes == 0) return FQ_OK;
    *out = malloc(bytes);
    if (!*out) return fq_fail(FQ_ERR_NOMEM, "FLASHQLA_CHECK_INPUTS: cannot allocate %zu bytes", bytes);
    cudaError_t err = cudaMemcpyAsync(*out, src, bytes, cudaMemcpyDeviceToHost, (cudaStream_t)p->stream);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        return fq_fail(FQ_ERR_CUDA, "FLASHQLA_CHECK_INPUTS: copying inputs to the host failed: %s",
                       cudaGetErrorString(err));
    }
    return FQ_OK;
}

/* See gdn_cuda_common.cuh. Reads the inputs as the caller's stream orders
 * them (the copies are queued on p->stream), then waits for that stream. */
extern "C" fq_status fq_cuda_check_contents(const fq_gdn_params *p, char op)
{
    if (!p->check_inputs) return FQ_OK;
    int prev = 0;
    fq_status st = fq_cuda_enter_device(p->device, &prev, "FLASHQLA_CHECK_INPUTS");
    if (st != FQ_OK) return st;
    void *g = NULL, *cu = NULL, *idx = NULL, *acc = NULL;
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    cudaError_t err = cudaStreamIsCapturing((cudaStream_t)p->stream, &cap);
    if (err != cudaSuccess || cap != cudaStreamCaptureStatusNone) {
        (void)cudaGetLastError();
        st = fq_fail(FQ_ERR_CUDA,
                     "FLASHQLA_CHECK_INPUTS=1 copies g, cu_seqlens and state_indices to the host, "
                     "which cannot happen inside a CUDA graph capture: unset it while capturing");
        goto done;
    }
    {
        const size_t isz_cu = p->cu_seqlens_is_int64 ? 8 : 4, isz_ix = p->state_indices_is_int64 ? 8 : 4;
        const size_t ng = (size_t)(p->B * p->T * p->HV) * fq_dtype_size(p->gate_dtype);
        if ((st = fq_cuda_copy_to_host(p, p->g, ng, &g)) != FQ_OK) goto done;
        if ((st = fq_cuda_copy_to_host(p, p->cu_seqlens, (size_t)(p->N + 1) * isz_cu, &cu)) != FQ_OK)
            goto done;
        if ((st = fq_cuda_copy_to_host(p, p->state_indices, (size_t)p->N * isz_ix, &idx)) != FQ_OK)
            goto done;
        if (op == 'c' && /* [serving] the commit's num_accepted */
            (st = fq_cuda_copy_to_host(p, p->num_accepted, (size_t)p->N * (p->num_accepted_is_int64 ? 8 : 4),
                                       &acc)) != FQ_OK)
            goto done;
        err = cudaStreamSynchronize((cudaStream_t)p->stream);
        if (err != cudaSuccess) {
            (void)cudaGetLastError();
            st = fq_fail(FQ_ERR_CUDA, "FLASHQLA_CHECK_INPUTS: waiting for the input copies failed: %s",
                         cudaGetErrorString(err));
            goto done;
        }
        fq_gdn_params h = *p; /* the same call, its contents in host memory */
        h.g = g ? g : p->g;   /* (an empty g is never read) */
        h.cu_seqlens = cu;
        h.state_indices = idx;
        h.num_accepted = acc;
        st = fq_check_contents(&h, op);
    }
done:
    free(acc);
    free(g);
    free(cu);
    free(idx);
    fq_cuda_leave_device(p->device, prev);
    return st;
}
