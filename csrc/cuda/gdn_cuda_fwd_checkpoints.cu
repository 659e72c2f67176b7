/*
 * gdn_cuda_fwd_checkpoints.cu — the bookkeeping of prefix-cache checkpoints
 * (gdn.h, checkpoint_every): the row index cu_checkpoints and the zero rows
 * past the last checkpoint. The states themselves are stored by the fused
 * forward's chain (gdn_cuda_fwd_fused.cu) or, in the three-stage forward that
 * serves where the fused kernel does not run, by the state pass
 * (gdn_cuda_fwd_state.cu, the hunks marked [serving]).
 *
 *     cu_checkpoints[n] = sum_{m < n} L_m / checkpoint_every      (n = 0 .. N)
 *     checkpoints[r] = 0 for cu_checkpoints[N] <= r < B * (T / checkpoint_every)
 *
 * L_m comes from the chunk table (ws->seqs), so invalid cu_seqlens (every
 * sequence treated as empty there) give cu_checkpoints = 0 and zero rows;
 * the forward then NaN-fills the checkpoints like its other outputs.
 */
#include "gdn_cuda_common.cuh"

/* One block of 1024 threads: exclusive scan of seqs[m].len / ne in blocks of
 * 1024 sequences with a running carry. */
__global__ void __launch_bounds__(1024) fq_ckpt_index_kernel(const fq_seq_info *seqs, int N, int64_t ne,
                                                             int64_t *cu)
{
    __shared__ int64_t s_warp[32];
    __shared__ int64_t s_carry;
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    if (tid == 0) s_carry = 0;
    __syncthreads();
    for (int base = 0; base < N; base += 1024) {
        const int i = base + tid;
        const int64_t c = i < N ? seqs[i].len / ne : 0;
        int64_t x = c; /* inclusive scan: warp, then the warp totals */
        for (int o = 1; o < 32; o <<= 1) {
            const int64_t y = __shfl_up_sync(0xffffffffu, x, o);
            if (lane >= o) x += y;
        }
        if (lane == 31) s_warp[wid] = x;
        __syncthreads();
        if (wid == 0) {
            int64_t w = s_warp[lane];
            for (int o = 1; o < 32; o <<= 1) {
                const int64_t y = __shfl_up_sync(0xffffffffu, w, o);
                if (lane >= o) w += y;
            }
            s_warp[lane] = w;
        }
        __syncthreads();
        const int64_t incl = x + (wid > 0 ? s_warp[wid - 1] : 0), carry = s_carry;
        if (i < N) cu[i] = carry + incl - c;
        __syncthreads();
        if (tid == 1023) s_carry = carry + incl;
        __syncthreads();
    }
    if (tid == 0) cu[N] = s_carry;
}

/* checkpoints[cu[N] * per ..< rows * per] = 0 (grid-stride) */
__global__ void fq_ckpt_zero_kernel(const int64_t *cu, int N, int64_t rows, int64_t per, float *ck)
{
    const int64_t end = rows * per;
    for (int64_t i = cu[N] * per + (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < end;
         i += (int64_t)gridDim.x * blockDim.x)
        ck[i] = 0.f;
}

extern "C" fq_status fq_cuda_fwd_checkpoint_index(const fq_gdn_params *p, const fq_fwd_ws *ws, cudaStream_t stream)
{
    if (!p->checkpoint_every) return FQ_OK;
    int64_t *cu = (int64_t *)p->cu_checkpoints;
    if (p->N <= 0) return FQ_OK;
    fq_ckpt_index_kernel<<<1, 1024, 0, stream>>>(ws->seqs, (int)p->N, p->checkpoint_every, cu);
    FQ_CUDA_CHECK_LAUNCH();
    const int64_t rows = fq_checkpoint_rows(p), per = p->HV * p->K * p->V;
    if (rows > 0) {
        int64_t blocks = (rows * per + 255) / 256;
        if (blocks > 1024) blocks = 1024;
        fq_ckpt_zero_kernel<<<(unsigned)blocks, 256, 0, stream>>>(cu, (int)p->N, rows, per, (float *)p->checkpoints);
        FQ_CUDA_CHECK_LAUNCH();
    }
    return FQ_OK;
}
