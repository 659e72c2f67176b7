"""flashqla.distributed — exact context parallelism over torch.distributed.

A packed token stream too long for one device is split across the ranks of a
process group: rank r holds tokens [r·TL, (r+1)·TL) of q, k, v, g, beta (B = 1,
the layout Megatron and FLA's context parallelism use), and a sequence may
cross any number of rank boundaries. Every rank passes the global cu_seqlens.

    o, ht = flashqla.distributed.gdn_chunk(q, k, v, g, beta, cu_seqlens=cu,
                                           initial_state=h0, output_final_state=True)

The result equals the single-process flashqla.gdn_chunk on the concatenated
stream: nothing is truncated, for every gate value (DESIGN §2).

How (per value head; S is the K×V state of the sequence that crosses a rank
boundary). A rank's slice of a sequence maps its start state affinely to its
end state, S_out = M S_in + D, with M (K×K) the linear part and D the end state
from S_in = 0 (with the sequence's initial state where it starts on the rank):

  forward
    1. M pass: the chunk forward with v = 0 and initial state I (value dim K) on
       the entering piece (the rank's first tokens, when they continue a
       sequence from rank r-1). Each column of S evolves on its own and v enters
       only additively, so the state at token t is M_t (the map of the tokens so
       far), its final state is M, and its output is oM_t = scale · M_tᵀ q_t.
    2. Local forward of the whole slice with the entering state set to 0: o0 and
       the end states; D is the end state of the leaving piece.
    3. One all-gather of [M_r | D_r] (K×(K+V) per head; M_r = 0 unless the
       entering sequence also leaves, D_r = 0 unless a sequence leaves), then
       S_in_r = S_out_{r-1} from S_out_j = M_j S_out_{j-1} + D_j, S_out_{-1} = 0.
    4. Exact corrections, since S_t = M_t S_in + (state from 0):
         o_t += oM_tᵀ S_in on the entering piece (oM is 0 elsewhere),
         ht[entering row] += M S_in.

  backward (the reverse affine map of dS)
    1. G_r = ∂L_r/∂S_in holding the leaving state fixed:
         G_r = Σ_t oM_t do_tᵀ + Mᵀ dht[entering row]  (that row only if it ends here).
    2. One all-gather of G (K×V per head), then the gradient of the leaving state,
         dS_out_r = dS_in_{r+1},  dS_in_j = G_j + M_jᵀ dS_out_j  (from the last rank down).
    3. Local backward with the true entering state S_in and dfinal_state = dS_out_r
       on the leaving row: exact gradients of every input of this rank.

Costs per rank beyond the single-device call on its slice: one forward with
value dim K (step 1), two K×V-per-token einsums, and K×(K+V) floats per head
exchanged forward and K×V backward. The split depends only on shapes: a device
cu_seqlens is never read on the host (a host one is checked, then copied), and
the collectives are ordered on the current stream. Capture in a CUDA graph
(device cu_seqlens, NCCL) is intended but not yet tried.

Precision: oM is kept in q's dtype, so with bf16 inputs the corrections and G
carry one more bf16 rounding than the single-device call (on the CPU backend at
bf16: dg, dbeta ~4e-4 and dh0 ~6e-5 relative error instead of ~1e-6, within
DESIGN §3's 2e-2 / 1e-2; o 2.2e-3 instead of 1.7e-3). float32 and float64 are
as exact as the single-device call.

Contract:
- Every rank calls with the same cu_seqlens (global offsets, [N+1], ending at
  W·TL), the same TL, head sizes, dtypes and options; every rank that runs
  forward under autograd must also run backward (the backward holds one
  collective). cu_seqlens=None means one sequence over the whole stream.
- initial_state [N, HV, K, V], the same on every rank, is used on the rank where
  sequence n starts; its gradient there is the full one, zero on the others
  (summed over ranks it equals the single-process gradient).
- Returns (o, final_state): o is the rank's slice [1, TL, HV, V]; final_state
  [N, HV, K, V] (or None unless output_final_state) holds on each rank the rows
  of the sequences that end there and zeros elsewhere (an empty sequence belongs
  to the rank holding its offset; offset W·TL to the last rank).
- Memory: the end states of all N sequences are computed on every rank (as the
  single-process call with output_final_state), and oM ([1, TL, HV, K], q's
  dtype) is kept for the backward.
"""

import torch
import torch.distributed as dist

from ._frameworks import TORCH, state_dtype_of
from ._prepared import chunk_bwd_prepared, chunk_fwd_prepared, prepare_inputs, resolve_scale

__all__ = ["gdn_chunk"]


def gdn_chunk(q, k, v, g, beta, *, group=None, scale=None, initial_state=None,
              output_final_state=False, cu_seqlens=None, use_qk_l2norm=False):
    """Gated delta rule, chunked, over the ranks of a torch.distributed group.

    q, k [1, TL, H, K], v [1, TL, HV, V], g, beta [1, TL, HV]: this rank's slice
    (tokens [r·TL, (r+1)·TL) of the packed stream); cu_seqlens [N+1] global
    offsets (the same on every rank; None: one sequence of W·TL tokens);
    initial_state [N, HV, K, V] (the same on every rank). Returns (o,
    final_state) as described in the module docstring. Gradients flow to q, k,
    v, g, beta and initial_state through torch.autograd; group=None is the
    default process group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("group: torch.distributed is not initialised "
                         "(call torch.distributed.init_process_group first)")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta),
                    ("initial_state", initial_state)):
        if x is not None and not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    fw, q, k, v, g, beta, h0, _ = prepare_inputs(q, k, v, g, beta, initial_state, None)
    if int(q.shape[0]) != 1:
        raise ValueError(f"q: expected batch size B == 1 (one packed stream), "
                         f"got shape {list(q.shape)}")
    TL, HV, K, V = int(q.shape[1]), int(v.shape[2]), int(q.shape[3]), int(v.shape[3])
    cu = _global_offsets(cu_seqlens, world * TL, q.device)
    N = int(cu.shape[0]) - 1
    if h0 is not None and tuple(h0.shape) != (N, HV, K, V):
        raise ValueError(f"initial_state: expected shape [N={N}, HV={HV}, K={K}, V={V}] "
                         f"(the same on every rank), got {list(h0.shape)}")
    o, ht = _ContextParallelChunk.apply(q, k, v, g, beta, h0, cu, group, world, rank,
                                        resolve_scale(scale, q), bool(use_qk_l2norm))
    return o, (ht if output_final_state else None)


def _global_offsets(cu_seqlens, total, device):
    """cu_seqlens as int64 on the device; checked on the host when it lives there."""
    if cu_seqlens is None:
        return torch.tensor([0, total], dtype=torch.int64, device=device)
    cu = cu_seqlens if isinstance(cu_seqlens, torch.Tensor) else torch.as_tensor(cu_seqlens)
    if cu.ndim != 1 or cu.shape[0] < 2:
        raise ValueError(f"cu_seqlens: expected [N + 1] offsets (at least 2), "
                         f"got shape {list(cu.shape)}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens: expected int32 or int64, got {cu.dtype}")
    if cu.device.type == "cpu":  # device offsets are not read back (no host sync)
        c = cu.tolist()
        if c[0] != 0 or any(b < a for a, b in zip(c, c[1:])) or c[-1] != total:
            shown = c if len(c) <= 12 else c[:6] + ["..."] + c[-6:]
            raise ValueError(f"cu_seqlens: expected non-decreasing global offsets from 0 "
                             f"to world_size·TL = {total}, got {shown}")
    return cu.to(device=device, dtype=torch.int64)


class _Layout:
    """Where the sequences lie relative to this rank's tokens [s, e), from the
    global offsets on the device. Masks are [N] bool (at most one true for
    entering / leaving), broadcast to states as [N, 1, 1, 1]."""

    def __init__(self, cu, world, rank, TL):
        s, e, total = rank * TL, (rank + 1) * TL, world * TL
        lo, hi = cu[:-1], cu[1:]
        self.local_cu = (cu - s).clamp(0, TL)          # this rank's pieces, [N + 1]
        self.entering = (lo < s) & (hi > s)            # continues from rank r - 1
        self.leaving = (lo < e) & (hi > e)             # continues on rank r + 1
        starts = ((lo >= s) & (lo < e)) | ((lo == total) & (rank == world - 1))
        self.starts = starts                           # initial_state row used here
        self.ends = torch.where(lo == hi, starts, (hi > s) & (hi <= e))  # final row valid here
        self.passes = (self.entering & self.leaving).any()  # one sequence spans the slice
        # the entering piece is local tokens [0, p): cut there for the M pass
        p = torch.where(self.entering, hi.clamp(max=e) - s, 0).max()
        self.m_cu = torch.stack([torch.zeros_like(p), p, torch.full_like(p, TL)])

    @staticmethod
    def rows(mask):
        return mask[:, None, None, None]


def _all_gather(x, group, world):
    """[...] -> [world, ...]: one collective (NCCL on CUDA tensors, gloo on CPU)."""
    x = x.contiguous()  # gathered as [world · d0, ...], the layout every backend takes
    out = torch.empty((world * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype,
                      device=x.device)
    dist.all_gather_into_tensor(out, x, group=group)
    return out.view((world,) + tuple(x.shape))


def _t(x):
    """Per-head transpose of [..., K, K]."""
    return x.transpose(-1, -2)


class _ContextParallelChunk(torch.autograd.Function):
    """(q, k, v, g, beta, h0, cu, group, world, rank, scale, use_qk_l2norm)
    -> (o, final_state); inputs prepared by gdn_chunk (contiguous, dtypes settled)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, cu, group, world, rank, scale, use_qk_l2norm):
        TL, HV, K = int(q.shape[1]), int(v.shape[2]), int(q.shape[3])
        sdt = getattr(torch, state_dtype_of(TORCH.dtype_name(q)))
        lay = _Layout(cu, world, rank, TL)
        rows = _Layout.rows

        # 1. M pass: v = 0 from S = I on the entering piece [0, p), from 0 after it
        #    (so oM = 0 there). Final row 0 is M of the entering piece (I if p = 0).
        h0_m = torch.zeros((2, HV, K, K), dtype=sdt, device=q.device)
        h0_m[0] = torch.eye(K, dtype=sdt, device=q.device)
        v_m = torch.zeros((1, TL, HV, K), dtype=v.dtype, device=v.device)
        o_m, m_final = chunk_fwd_prepared(TORCH, q, k, v_m, g, beta, h0_m, lay.m_cu, scale,
                                          True, use_qk_l2norm)
        m_in = m_final[0]                                               # [HV, K, K]

        # 2. local forward, the entering sequence from S = 0
        h0_zero = None if h0 is None else torch.where(rows(lay.entering), 0, h0)
        o0, ht0 = chunk_fwd_prepared(TORCH, q, k, v, g, beta, h0_zero, lay.local_cu, scale,
                                     True, use_qk_l2norm)

        # 3. exchange [M_r | D_r]; S_out_j = M_j S_out_{j-1} + D_j; S_in = S_out_{r-1}
        m_r = torch.where(lay.passes, m_in, 0)
        d_r = torch.where(rows(lay.leaving), ht0, 0).sum(0)            # [HV, K, V]
        md = _all_gather(torch.cat([m_r, d_r], dim=-1), group, world)  # [W, HV, K, K+V]
        m_all, d_all = md[..., :K], md[..., K:]
        s_in = torch.zeros_like(d_r)
        for j in range(rank):
            s_in = m_all[j] @ s_in + d_all[j]

        # 4. S_t = M_t S_in + (state from 0): o_t += oM_tᵀ S_in, ht += M S_in
        o = (o0.to(sdt) + torch.einsum("bthk,hkv->bthv", o_m.to(sdt), s_in)).to(o0.dtype)
        ht = ht0 + torch.where(rows(lay.entering), m_in @ s_in, 0)
        ht = torch.where(rows(lay.ends), ht, 0)

        ctx.save_for_backward(q, k, v, g, beta, h0, cu, o_m, m_in, m_all, s_in)
        ctx.group, ctx.world, ctx.rank = group, world, rank
        ctx.scale, ctx.use_qk_l2norm = scale, use_qk_l2norm
        ctx.set_materialize_grads(False)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0, cu, o_m, m_in, m_all, s_in = ctx.saved_tensors
        world, rank = ctx.world, ctx.rank
        N, TL = int(cu.shape[0]) - 1, int(q.shape[1])
        lay = _Layout(cu, world, rank, TL)
        rows = _Layout.rows
        if do is None:  # only the final state was used
            do = torch.zeros((1, TL) + tuple(v.shape[2:]), dtype=q.dtype, device=q.device)
        if dht is not None:
            dht = torch.where(rows(lay.ends), dht.to(s_in.dtype), 0)

        # 1. G_r = Σ_t oM_t do_tᵀ + Mᵀ dht[entering row] (in the forward: o_t += oM_tᵀ S_in,
        #    ht += M S_in); the entering row's dht is 0 unless the sequence ends here
        grad_in = torch.einsum("bthk,bthv->hkv", o_m.to(s_in.dtype), do.to(s_in.dtype))
        if dht is not None:
            grad_in = grad_in + _t(m_in) @ torch.where(rows(lay.entering), dht, 0).sum(0)

        # 2. exchange G; dS_out_r = dS_in_{r+1}, dS_in_j = G_j + M_jᵀ dS_out_j
        #    (in the forward: S_out_j = M_j S_out_{j-1} + D_j)
        g_all = _all_gather(grad_in, ctx.group, world)                 # [W, HV, K, V]
        ds_out = torch.zeros_like(grad_in)
        for j in range(world - 1, rank, -1):
            ds_out = g_all[j] + _t(m_all[j]) @ ds_out

        # 3. local backward from the true entering state, dS_out on the leaving row
        h0_true = torch.zeros((N,) + tuple(s_in.shape), dtype=s_in.dtype, device=q.device) \
            if h0 is None else h0
        h0_true = torch.where(rows(lay.entering), s_in, h0_true)
        dht_true = torch.where(rows(lay.leaving), ds_out, 0 if dht is None else dht)
        dq, dk, dv, dg, dbeta, dh0, _, _ = chunk_bwd_prepared(
            TORCH, q, k, v, g, beta, h0_true, lay.local_cu, ctx.scale, ctx.use_qk_l2norm,
            do, dht_true)
        dh0 = None if h0 is None else torch.where(rows(lay.starts), dh0, 0)
        return dq, dk, dv, dg, dbeta, dh0, None, None, None, None, None, None
