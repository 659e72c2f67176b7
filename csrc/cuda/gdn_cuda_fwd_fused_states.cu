/*
 * gdn_cuda_fwd_fused_states.cu — the backward's recompute on the fused forward
 * kernel (gdn_cuda_fwd_fused.cuh), mode HST: per chunk the state at its start
 * (h, bf16 [K][V]) and Vn (bf16 [64][V]) to the three-stage workspace layout
 * that bwd_local, bwd_state and bwd_wy read (gdn_cuda_bwd.cu), no o, no ht.
 * The chain is the forward's, so long sequences get its exact context
 * parallelism (the MAP pass and combine of gdn_cuda_fwd_fused.cu first) and
 * few-chain rows stage A beside it. A translation unit of its own: with HST
 * instantiated beside FULL and MAP, those two compiled differently.
 */
#ifdef FQ_FUSED_TIMELINE /* (the timeline records the forward's FULL pass only) */
#undef FQ_FUSED_TIMELINE
#endif
#include "gdn_cuda_fwd_fused.cuh"

template <int K>
static fq_status fq_fwd_fused_states_k(const fq_gdn_params *p, const fq_fwd_ws *ws, int beside, fq_bf16 *h,
                                       fq_bf16 *vn, cudaStream_t stream)
{
    if (ws->seg_bound <= 0) return FQ_OK;
    fq_status st;
    fq_fused_maps m;
    if ((st = fq_fused_maps_of<K>(p, ws, &m)) != FQ_OK) return st;
    if ((st = fq_cuda_fwd_fused_cp(p, ws, stream)) != FQ_OK) return st;
    return fq_launch_fused<K, FQ_FUSED_HST>(p, ws, m, beside ? ws->ready : NULL, h, vn, stream);
}

extern "C" fq_status fq_cuda_fwd_fused_states(const fq_gdn_params *p, const fq_fwd_ws *ws, int beside, fq_bf16 *h,
                                              fq_bf16 *vn, cudaStream_t stream)
{
    if (!h || !vn) return fq_fail(FQ_ERR_INTERNAL, "fq_cuda_fwd_fused_states: no h / vn");
    if (p->K == 128) return fq_fwd_fused_states_k<128>(p, ws, beside, h, vn, stream);
    if (p->K == 64) return fq_fwd_fused_states_k<64>(p, ws, beside, h, vn, stream);
    return fq_cuda_head_dims_unsupported(p);
}
