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
    /* the stores' maps in the slots HST has no other use for: o = h [nc_max HV][K][V] (boxes
     * of K rows x 64 columns), q = vn [nc_max HV][64][V] (64 x 64); SWIZZLE_128B as the
     * staging tiles */
    const uint64_t tiles = ws->nc_max * p->HV > 0 ? (uint64_t)(ws->nc_max * p->HV) : 1;
    const uint64_t dh[3] = {(uint64_t)p->V, (uint64_t)K, tiles}, sh[2] = {(uint64_t)p->V * 2, (uint64_t)K * p->V * 2};
    const uint64_t dn[3] = {(uint64_t)p->V, 64, tiles}, sn[2] = {(uint64_t)p->V * 2, (uint64_t)64 * p->V * 2};
    const uint32_t bh[3] = {64, (uint32_t)K, 1}, bn[3] = {64, 64, 1};
    if ((st = fq_tmap(&m.o, h, 3, dh, sh, bh)) != FQ_OK) return st;
    if ((st = fq_tmap(&m.q, vn, 3, dn, sn, bn)) != FQ_OK) return st;
    if ((st = fq_fwd_fused_cp(p, ws, m, stream)) != FQ_OK) return st; /* (MAP reads k and v only) */
    return fq_launch_fused<K, FQ_FUSED_HST>(p, ws, m, beside ? ws->ready : NULL, stream);
}

extern "C" fq_status fq_cuda_fwd_fused_states(const fq_gdn_params *p, const fq_fwd_ws *ws, int beside, fq_bf16 *h,
                                              fq_bf16 *vn, cudaStream_t stream)
{
    if (!h || !vn) return fq_fail(FQ_ERR_INTERNAL, "fq_cuda_fwd_fused_states: no h / vn");
    if (p->K == 128) return fq_fwd_fused_states_k<128>(p, ws, beside, h, vn, stream);
    if (p->K == 64) return fq_fwd_fused_states_k<64>(p, ws, beside, h, vn, stream);
    return fq_cuda_head_dims_unsupported(p);
}
