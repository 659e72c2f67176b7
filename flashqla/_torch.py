"""The PyTorch front-end: autograd for flashqla.gdn_chunk (imported only with
PyTorch inputs; calls down into _prepared.py, never up into _api.py).

The forward saves its (prepared) inputs; the backward calls the C backward,
which recomputes every intermediate from them. Casts and .contiguous() are
done by the caller outside this Function, so autograd takes the gradients
back through them (e.g. to bfloat16 gates)."""

import torch

from ._prepared import chunk_bwd_prepared, chunk_fwd_prepared
from ._frameworks import TORCH


class ChunkFunction(torch.autograd.Function):
    """(q, k, v, g, beta, h0, cu_seqlens, scale, output_final_state,
    use_qk_l2norm) -> (o, final_state or None)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, cu_seqlens, scale, output_final_state,
                use_qk_l2norm):
        o, ht = chunk_fwd_prepared(TORCH, q, k, v, g, beta, h0, cu_seqlens, scale,
                                   output_final_state, use_qk_l2norm)
        ctx.save_for_backward(q, k, v, g, beta, h0, cu_seqlens)
        ctx.scale = scale
        ctx.use_qk_l2norm = use_qk_l2norm
        ctx.set_materialize_grads(False)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0, cu = ctx.saved_tensors
        if do is None:  # only the final state was used
            do = torch.zeros((q.shape[0], q.shape[1], v.shape[2], v.shape[3]),
                             dtype=q.dtype, device=q.device)
        dq, dk, dv, dg, dbeta, dh0 = chunk_bwd_prepared(
            TORCH, q, k, v, g, beta, h0, cu, ctx.scale, ctx.use_qk_l2norm, do, dht)
        return dq, dk, dv, dg, dbeta, dh0, None, None, None, None
