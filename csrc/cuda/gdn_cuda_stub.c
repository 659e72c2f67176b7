/*
 * gdn_cuda_stub.c — the CUDA entry points of gdn.h for a build without CUDA
 * (no nvcc found at build time, or FLASHQLA_NO_CUDA=1). setup.py compiles
 * this file instead of the .cu files. fq_cuda_built() says 0; every other
 * entry point fails with FQ_ERR_UNSUPPORTED (the binding raises
 * flashqla.Error), and no call needs a workspace.
 */
#include "gdn.h"

#define FQ_NO_CUDA_MESSAGE "flashqla was built without CUDA (no nvcc found at build time)"

int fq_cuda_built(void) { return 0; }

size_t fq_cuda_chunk_fwd_workspace_bytes(const fq_gdn_params *p) { (void)p; return 0; }
size_t fq_cuda_chunk_bwd_workspace_bytes(const fq_gdn_params *p) { (void)p; return 0; }
size_t fq_cuda_recurrent_workspace_bytes(const fq_gdn_params *p) { (void)p; return 0; }

fq_status fq_cuda_chunk_fwd(const fq_gdn_params *p)
{
    (void)p;
    return fq_fail(FQ_ERR_UNSUPPORTED, FQ_NO_CUDA_MESSAGE);
}

fq_status fq_cuda_chunk_bwd(const fq_gdn_params *p)
{
    (void)p;
    return fq_fail(FQ_ERR_UNSUPPORTED, FQ_NO_CUDA_MESSAGE);
}

fq_status fq_cuda_recurrent(const fq_gdn_params *p)
{
    (void)p;
    return fq_fail(FQ_ERR_UNSUPPORTED, FQ_NO_CUDA_MESSAGE);
}

fq_status fq_cuda_commit(const fq_gdn_params *p)
{
    (void)p;
    return fq_fail(FQ_ERR_UNSUPPORTED, FQ_NO_CUDA_MESSAGE);
}
