"""The PyTorch front-end: flashqla's kernels as PyTorch operators.

Three custom operators (torch.library), so torch.compile, torch.func, AOT
autograd and CUDA graphs see flashqla as one opaque op each:

    torch.ops.flashqla.chunk_fwd(q, k, v, g, beta, initial_state, cu_seqlens,
                                 scale, output_final_state, use_qk_l2norm)
        -> (o [B,T,HV,V], final_state [N,HV,K,V], or [0] when not requested)
    torch.ops.flashqla.chunk_bwd(q, k, v, g, beta, initial_state, cu_seqlens,
                                 do, dfinal_state, scale, use_qk_l2norm)
        -> (dq, dk, dv, dg, dbeta, dinitial_state, or [0] without initial_state)
    torch.ops.flashqla.recurrent(q, k, v, g, beta, state, state_indices,
                                 cu_seqlens, scale, use_qk_l2norm) -> o
        (mutates state [P,HV,K,V] in place)

Each has a fake (meta) kernel giving output shapes and dtypes without
running, chunk_fwd has its autograd formula (register_autograd: the
backward is chunk_bwd, which recomputes every intermediate from the saved
inputs), and the forward and backward have vmap rules (torch.func.vmap folds
the mapped axis into B). The real kernels call down into _prepared.py: on CUDA they launch
on the current stream with scratch allocated by torch, so they can be
captured in CUDA graphs.

The ops take prepared inputs (contiguous; gates float32 or q's dtype; states
float32, float64 with float64 inputs): the public functions (gdn_chunk,
gdn_recurrent here, called by _api.py) do those casts before the op, outside
it, so autograd takes gradients back through them. Imports run one way: this
module calls _prepared.py and never _api.py.
"""

from typing import Optional

import torch
from torch import Tensor

from ._frameworks import TORCH, _numpy_index, scale_of
from ._prepared import chunk_bwd_prepared, chunk_fwd_prepared, recurrent_prepared

__all__ = ["chunk_fwd", "chunk_bwd", "recurrent", "gdn_chunk", "gdn_recurrent"]


def _state_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _num_sequences(q, cu_seqlens):
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


# ----------------------------------------------------------------- chunk_fwd --

@torch.library.custom_op("flashqla::chunk_fwd", mutates_args=())
def chunk_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
              initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor], scale: float,
              output_final_state: bool, use_qk_l2norm: bool) -> tuple[Tensor, Tensor]:
    """Chunked forward: (o [B,T,HV,V], final_state [N,HV,K,V] or an empty [0]
    tensor when output_final_state is False)."""
    o, ht = chunk_fwd_prepared(TORCH, q, k, v, g, beta, initial_state, cu_seqlens, scale,
                               output_final_state, use_qk_l2norm)
    if ht is None:
        ht = q.new_empty((0,), dtype=_state_dtype(q.dtype))
    return o, ht


@chunk_fwd.register_fake
def _chunk_fwd_fake(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state,
                    use_qk_l2norm):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    o = q.new_empty((B, T, HV, V))
    shape = (_num_sequences(q, cu_seqlens), HV, K, V) if output_final_state else (0,)
    return o, q.new_empty(shape, dtype=_state_dtype(q.dtype))


# ----------------------------------------------------------------- chunk_bwd --

@torch.library.custom_op("flashqla::chunk_bwd", mutates_args=())
def chunk_bwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
              initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor], do: Tensor,
              dfinal_state: Optional[Tensor], scale: float,
              use_qk_l2norm: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Chunked backward from do (and dfinal_state): (dq, dk, dv, dg, dbeta,
    dinitial_state), each like its input; dinitial_state an empty [0] tensor
    without initial_state."""
    grads = chunk_bwd_prepared(TORCH, q, k, v, g, beta, initial_state, cu_seqlens, scale,
                               use_qk_l2norm, do, dfinal_state)
    dh0 = grads[5] if grads[5] is not None else q.new_empty((0,), dtype=_state_dtype(q.dtype))
    return grads[:5] + (dh0,)


@chunk_bwd.register_fake
def _chunk_bwd_fake(q, k, v, g, beta, initial_state, cu_seqlens, do, dfinal_state, scale,
                    use_qk_l2norm):
    dh0 = (torch.empty_like(initial_state) if initial_state is not None
           else q.new_empty((0,), dtype=_state_dtype(q.dtype)))
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), dh0)


def _vmap_batched(n, x, d):
    """x with its mapped axis d first ([n, ...]); an unmapped x expanded to it."""
    if x is None:
        return None
    return x.movedim(d, 0) if d is not None else x.expand(n, *x.shape)


def _vmap_fold(x):
    """[n, B, ...] -> [n * B, ...]: the mapped axis folded into the batch."""
    return None if x is None else x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).contiguous()


@torch.library.register_vmap("flashqla::chunk_bwd")
def _chunk_bwd_vmap(info, in_dims, q, k, v, g, beta, h0, cu, do, dht, scale, use_qk_l2norm):
    """torch.func.vmap of the backward (vmap of grad: per-sample gradients):
    the mapped axis folded into B and N as in the forward's vmap."""
    n = info.batch_size
    names = (q, k, v, g, beta, h0, None, do, dht)
    xs = [_vmap_batched(n, x, d) for x, d in zip(names, in_dims)]
    if cu is not None:
        if in_dims[6] is not None:
            raise ValueError("cu_seqlens: torch.func.vmap over cu_seqlens is not supported")
        outs = [torch.ops.flashqla.chunk_bwd(*[None if x is None else x[i] for x in xs[:6]], cu,
                                             xs[7][i], None if xs[8] is None else xs[8][i],
                                             scale, use_qk_l2norm) for i in range(n)]
        return tuple(torch.stack(list(gs)) for gs in zip(*outs)), (0,) * 6
    f = [_vmap_fold(x) for x in xs]
    grads = torch.ops.flashqla.chunk_bwd(*f[:6], None, f[7], f[8], scale, use_qk_l2norm)
    out = tuple(x.reshape(n, -1, *x.shape[1:]) for x in grads[:5])
    if h0 is not None:
        return out + (grads[5].reshape(n, -1, *grads[5].shape[1:]),), (0,) * 6
    return out + (grads[5],), (0, 0, 0, 0, 0, None)


# ----------------------------------------------------- autograd of chunk_fwd --

def _chunk_setup_context(ctx, inputs, output):
    q, k, v, g, beta, h0, cu, scale, output_final_state, use_qk_l2norm = inputs
    ctx.save_for_backward(q, k, v, g, beta, h0, cu)
    ctx.scale = scale
    ctx.output_final_state = output_final_state
    ctx.use_qk_l2norm = use_qk_l2norm


def _chunk_backward(ctx, do, dht):
    q, k, v, g, beta, h0, cu = ctx.saved_tensors
    if do is None:  # only the final state was used
        do = q.new_zeros((q.shape[0], q.shape[1], v.shape[2], v.shape[3]))
    if not ctx.output_final_state:
        dht = None  # the [0] placeholder has no gradient to give
    with torch.no_grad():  # once differentiable: chunk_bwd has no backward of its own
        dq, dk, dv, dg, dbeta, dh0 = torch.ops.flashqla.chunk_bwd(
            q, k, v, g, beta, h0, cu, do, dht, ctx.scale, ctx.use_qk_l2norm)
    return dq, dk, dv, dg, dbeta, (dh0 if h0 is not None else None), None, None, None, None


# for callers of torch.ops.flashqla.chunk_fwd itself (and torch.library.opcheck)
chunk_fwd.register_autograd(_chunk_backward, setup_context=_chunk_setup_context)


class _ChunkFunction(torch.autograd.Function):
    """The same forward op and backward formula as a torch.autograd.Function
    with setup_context, which the torch.func transforms (torch.func.grad, ...)
    accept; the op's own autograd registration is a Function they do not."""

    @staticmethod
    def forward(q, k, v, g, beta, h0, cu, scale, output_final_state, use_qk_l2norm):
        return torch.ops.flashqla.chunk_fwd(q, k, v, g, beta, h0, cu, scale, output_final_state,
                                            use_qk_l2norm)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _chunk_setup_context(ctx, inputs, output)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, do, dht):
        return _chunk_backward(ctx, do, dht)

    @staticmethod
    def vmap(info, in_dims, q, k, v, g, beta, h0, cu, scale, output_final_state, use_qk_l2norm):
        """torch.func.vmap: the mapped axis folded into the batch B (and N),
        one call for the whole vmap; with cu_seqlens (B == 1 packed), one
        call per member."""
        n = info.batch_size
        xs = [_vmap_batched(n, x, d) for x, d in zip((q, k, v, g, beta, h0), in_dims[:6])]
        if cu is not None:
            if in_dims[6] is not None:
                raise ValueError("cu_seqlens: torch.func.vmap over cu_seqlens is not supported "
                                 "(pack the sequences into one call instead)")
            outs = [_ChunkFunction.apply(*[None if x is None else x[i] for x in xs], cu, scale,
                                         output_final_state, use_qk_l2norm) for i in range(n)]
            return (torch.stack([o for o, _ in outs]), torch.stack([h for _, h in outs])), (0, 0)
        o, ht = _ChunkFunction.apply(*[_vmap_fold(x) for x in xs], None, scale,
                                     output_final_state, use_qk_l2norm)
        o = o.reshape(n, -1, *o.shape[1:])
        if output_final_state:
            return (o, ht.reshape(n, -1, *ht.shape[1:])), (0, 0)
        return (o, ht), (0, None)  # the [0] placeholder is not mapped


# ----------------------------------------------------------------- recurrent --

@torch.library.custom_op("flashqla::recurrent", mutates_args=("state",))
def recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
              state_indices: Optional[Tensor], cu_seqlens: Optional[Tensor], scale: float,
              use_qk_l2norm: bool) -> Tensor:
    """Recurrent step: updates the pool `state` [P,HV,K,V] in place, returns
    o [B,T,HV,V]."""
    return recurrent_prepared(TORCH, q, k, v, g, beta, state, state_indices, cu_seqlens, scale,
                              use_qk_l2norm)


@recurrent.register_fake
def _recurrent_fake(q, k, v, g, beta, state, state_indices, cu_seqlens, scale, use_qk_l2norm):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2], v.shape[3]))


# -------------------------------------------------------- public, for torch --

def _gates(q, g, beta):
    """g and beta as the core takes them: both float32 or both q's dtype; any
    other float gate is cast to float32 (autograd casts the gradient back)."""
    if g.dtype == beta.dtype and (g.dtype == torch.float32 or g.dtype == q.dtype):
        return g, beta
    if g.is_floating_point() and beta.is_floating_point():
        return g.float(), beta.float()
    return g, beta  # the core names the bad dtype


def _state(x, q):
    if x is None:
        return None
    want = _state_dtype(q.dtype)
    if x.is_floating_point() and x.dtype != want:
        x = x.to(want)
    return x.contiguous()


def _index(x, q, name):
    if x is None:
        return None
    if not isinstance(x, torch.Tensor):  # lists, NumPy: integers only (no bool, str, fraction)
        x = torch.as_tensor(_numpy_index(x, name))
    if x.device != q.device:
        x = x.to(q.device)
    return x.contiguous()


def _check_ndim(x, name, ndim, layout):
    if x is not None and x.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions {layout}, got shape {list(x.shape)}")


def gdn_chunk(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, use_qk_l2norm=False):
    """flashqla.gdn_chunk for PyTorch tensors, through torch.ops.flashqla.chunk_fwd."""
    _check_ndim(q, "q", 4, "[B, T, H, K]")
    _check_ndim(k, "k", 4, "[B, T, H, K]")
    _check_ndim(v, "v", 4, "[B, T, HV, V]")
    _check_ndim(g, "g", 3, "[B, T, HV]")
    _check_ndim(beta, "beta", 3, "[B, T, HV]")
    _check_ndim(initial_state, "initial_state", 4, "[N, HV, K, V]")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta = _gates(q, g.contiguous(), beta.contiguous())
    h0 = _state(initial_state, q)
    cu = _index(cu_seqlens, q, "cu_seqlens")
    _check_ndim(cu, "cu_seqlens", 1, "[N + 1]")
    scale = scale_of(scale, q)
    args = (q, k, v, g, beta, h0, cu, scale, bool(output_final_state), bool(use_qk_l2norm))
    if torch._C._are_functorch_transforms_active() or (
            torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in args[:6])):
        o, ht = _ChunkFunction.apply(*args)  # autograd, torch.func (grad, vmap)
    else:
        o, ht = torch.ops.flashqla.chunk_fwd(*args)
    return o, (ht if output_final_state else None)


def gdn_recurrent(q, k, v, g, beta, state, *, state_indices=None, scale=None, cu_seqlens=None,
                  use_qk_l2norm=False):
    """flashqla.gdn_recurrent for PyTorch tensors, through torch.ops.flashqla.recurrent
    (no gradients: the inputs are detached; the pool is updated in place)."""
    _check_ndim(q, "q", 4, "[B, T, H, K]")
    _check_ndim(k, "k", 4, "[B, T, H, K]")
    _check_ndim(v, "v", 4, "[B, T, HV, V]")
    _check_ndim(g, "g", 3, "[B, T, HV]")
    _check_ndim(beta, "beta", 3, "[B, T, HV]")
    _check_ndim(state, "state", 4, "[P, HV, K, V]")
    q, k, v, g, beta, state = (x.detach() if x.requires_grad else x for x in (q, k, v, g, beta, state))
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta = _gates(q, g.contiguous(), beta.contiguous())
    idx = _index(state_indices, q, "state_indices")
    _check_ndim(idx, "state_indices", 1, "[N]")
    cu = _index(cu_seqlens, q, "cu_seqlens")
    _check_ndim(cu, "cu_seqlens", 1, "[N + 1]")
    scale = scale_of(scale, q)
    if _plain_eager(q, k, v, g, beta, state, idx, cu):
        # the op's own kernel, without the ~10 us of the dispatcher's Python
        # custom-op machinery: decoding calls this once per layer and token
        return recurrent_prepared(TORCH, q, k, v, g, beta, state, idx, cu, scale,
                                  bool(use_qk_l2norm))
    return torch.ops.flashqla.recurrent(q, k, v, g, beta, state, idx, cu, scale,
                                        bool(use_qk_l2norm))


def _plain_eager(*tensors):
    """True when calling an op's kernel directly is the same as calling the op:
    eager mode (no torch.compile tracing), no torch.func transform, no
    dispatch or function mode (make_fx, FakeTensorMode, a TorchFunctionMode,
    ...) and plain torch.Tensor arguments (no subclass: FakeTensor, DTensor)."""
    if (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
            or torch._C._len_torch_dispatch_stack() or torch._C._len_torch_function_stack()):
        return False
    return all(x is None or type(x) is Tensor for x in tensors)

