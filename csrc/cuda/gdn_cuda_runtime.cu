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

extern "C" fq_status fq_cuda_alloc(int device, size_t bytes, void **ptr)
{
    int prev = 0;
    *ptr = NULL;
    fq_status st = fq_cuda_enter_device(device, &prev, "cudaMalloc");
    if (st != FQ_OK) return st;
    /* cudaMalloc(0) returns NULL; a 1-byte allocation keeps pointers unique. */
    cudaError_t err = cudaMalloc(ptr, bytes > 0 ? bytes : 1);
    if (err != cudaSuccess) {
        (void)cudaGetLastError(); /* allocation errors are not sticky: clear */
        *ptr = NULL;
        st = fq_fail(FQ_ERR_CUDA, "cudaMalloc of %zu bytes on cuda:%d failed: %s", bytes,
                     device, cudaGetErrorString(err));
    }
    fq_cuda_leave_device(device, prev);
    return st;
}

extern "C" fq_status fq_cuda_free(int device, void *ptr)
{
    if (!ptr) return FQ_OK;
    int prev = 0;
    fq_status st = fq_cuda_enter_device(device, &prev, "cudaFree");
    if (st != FQ_OK) return st;
    cudaError_t err = cudaFree(ptr);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        st = fq_fail(FQ_ERR_CUDA, "cudaFree on cuda:%d failed: %s", device,
                     cudaGetErrorString(err));
    }
    fq_cuda_leave_device(device, prev);
    return st;
}

/* stream NULL: the legacy default stream of `device`. */
extern "C" fq_status fq_cuda_synchronize_stream(int device, void *stream)
{
    int prev = 0;
    fq_status st = fq_cuda_enter_device(device, &prev, "cudaStreamSynchronize");
    if (st != FQ_OK) return st;
    cudaError_t err = cudaStreamSynchronize((cudaStream_t)stream);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        st = fq_fail(FQ_ERR_CUDA, "cudaStreamSynchronize on cuda:%d failed: %s", device,
                     cudaGetErrorString(err));
    }
    fq_cuda_leave_device(device, prev);
    return st;
}
