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

and the serving forms of issue 11 (forward only):

    torch.ops.flashqla.chunk_fwd_serving(..., state, state_indices, ..., checkpoint_every)
        -> (o, final_state, checkpoints, cu_checkpoints)   (mutates state: pool-indexed prefill)
    torch.ops.flashqla.commit(state, intermediate_states, state_indices, num_accepted,
                              state_layout)                (mutates state)

chunk_fwd, chunk_bwd and recurrent take the serving options as trailing
arguments with defaults: A_log, dt_bias (fused gates), use_gate_in_kernel,
use_beta_sigmoid_in_kernel, state_layout ("kv" or "vk"); recurrent also
intermediate_states (mutated) and update_state. chunk_bwd returns dA_log and
ddt_bias after dinitial_state ([0] placeholders without fused gates).

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
from torch.utils.dlpack import to_dlpack as _to_dlpack

from . import _C
from ._frameworks import TORCH, _numpy_index, scale_of
from ._prepared import (NO_GATES, FusedGates, check_layout, chunk_bwd_prepared,
                        chunk_fwd_prepared, commit_prepared, prepare_gate_params,
                        recurrent_prepared, state_dims)

__all__ = ["chunk_fwd", "chunk_bwd", "recurrent", "chunk_fwd_serving", "commit", "gdn_chunk",
           "gdn_recurrent", "gdn_commit"]


def _state_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _num_sequences(q, cu_seqlens):
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


# ----------------------------------------------------------------- chunk_fwd --

@torch.library.custom_op("flashqla::chunk_fwd", mutates_args=())
def chunk_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
              initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor], scale: float,
              output_final_state: bool, use_qk_l2norm: bool, A_log: Optional[Tensor] = None,
              dt_bias: Optional[Tensor] = None, use_gate_in_kernel: bool = False,
              use_beta_sigmoid_in_kernel: bool = False,
              state_layout: str = "kv") -> tuple[Tensor, Tensor]:
    """Chunked forward: (o [B,T,HV,V], final_state [N,HV,K,V] or an empty [0]
    tensor when output_final_state is False)."""
    gates = FusedGates(use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel)
    o, ht = chunk_fwd_prepared(TORCH, q, k, v, g, beta, initial_state, cu_seqlens, scale,
                               output_final_state, use_qk_l2norm, gates, state_layout)
    if ht is None:
        ht = q.new_empty((0,), dtype=_state_dtype(q.dtype))
    return o, ht


@chunk_fwd.register_fake
def _chunk_fwd_fake(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state,
                    use_qk_l2norm, A_log=None, dt_bias=None, use_gate_in_kernel=False,
                    use_beta_sigmoid_in_kernel=False, state_layout="kv"):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    o = q.new_empty((B, T, HV, V))
    shape = ((_num_sequences(q, cu_seqlens), HV) + state_dims(K, V, state_layout)
             if output_final_state else (0,))
    return o, q.new_empty(shape, dtype=_state_dtype(q.dtype))


# ----------------------------------------------------------------- chunk_bwd --

@torch.library.custom_op("flashqla::chunk_bwd", mutates_args=())
def chunk_bwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
              initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor], do: Tensor,
              dfinal_state: Optional[Tensor], scale: float, use_qk_l2norm: bool,
              A_log: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None,
              use_gate_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
              state_layout: str = "kv"
              ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Chunked backward from do (and dfinal_state): (dq, dk, dv, dg, dbeta,
    dinitial_state, dA_log, ddt_bias), each like its input; an empty [0]
    tensor for dinitial_state without initial_state and for dA_log, ddt_bias
    without use_gate_in_kernel / dt_bias. With fused gates dg, dbeta are the
    gradients of the raw a, b."""
    gates = FusedGates(use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel)
    grads = chunk_bwd_prepared(TORCH, q, k, v, g, beta, initial_state, cu_seqlens, scale,
                               use_qk_l2norm, do, dfinal_state, gates, state_layout)
    empty = q.new_empty((0,), dtype=_state_dtype(q.dtype))
    return grads[:5] + tuple(x if x is not None else empty.clone() for x in grads[5:])


@chunk_bwd.register_fake
def _chunk_bwd_fake(q, k, v, g, beta, initial_state, cu_seqlens, do, dfinal_state, scale,
                    use_qk_l2norm, A_log=None, dt_bias=None, use_gate_in_kernel=False,
                    use_beta_sigmoid_in_kernel=False, state_layout="kv"):
    empty = lambda: q.new_empty((0,), dtype=_state_dtype(q.dtype))  # noqa: E731
    dh0 = torch.empty_like(initial_state) if initial_state is not None else empty()
    dA = torch.empty_like(A_log) if use_gate_in_kernel and A_log is not None else empty()
    ddt = torch.empty_like(dt_bias) if use_gate_in_kernel and dt_bias is not None else empty()
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), dh0, dA, ddt)


def _vmap_batched(n, x, d):
    """x with its mapped axis d first ([n, ...]); an unmapped x expanded to it."""
    if x is None:
        return None
    return x.movedim(d, 0) if d is not None else x.expand(n, *x.shape)


def _vmap_fold(x):
    """[n, B, ...] -> [n * B, ...]: the mapped axis folded into the batch."""
    return None if x is None else x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).contiguous()


def _vmap_unmapped_params(in_dims, first):
    """A_log, dt_bias (arguments first, first + 1) are per model, not per vmap member."""
    if any(d is not None for d in in_dims[first:first + 2]):
        raise ValueError("A_log, dt_bias: torch.func.vmap over the gate parameters is not supported")


@torch.library.register_vmap("flashqla::chunk_bwd")
def _chunk_bwd_vmap(info, in_dims, q, k, v, g, beta, h0, cu, do, dht, scale, use_qk_l2norm,
                    A_log=None, dt_bias=None, use_gate_in_kernel=False,
                    use_beta_sigmoid_in_kernel=False, state_layout="kv"):
    """torch.func.vmap of the backward (vmap of grad: per-sample gradients):
    the mapped axis folded into B and N as in the forward's vmap; one call per
    member with cu_seqlens, and with fused gates (dA_log, ddt_bias are sums
    over the batch, per member here)."""
    n = info.batch_size
    _vmap_unmapped_params(in_dims, 11)
    names = (q, k, v, g, beta, h0, None, do, dht)
    xs = [_vmap_batched(n, x, d) for x, d in zip(names, in_dims)]
    serving = (A_log, dt_bias, use_gate_in_kernel, use_beta_sigmoid_in_kernel, state_layout)
    if cu is not None or use_gate_in_kernel:
        if cu is not None and in_dims[6] is not None:
            raise ValueError("cu_seqlens: torch.func.vmap over cu_seqlens is not supported")
        outs = [torch.ops.flashqla.chunk_bwd(*[None if x is None else x[i] for x in xs[:6]], cu,
                                             xs[7][i], None if xs[8] is None else xs[8][i],
                                             scale, use_qk_l2norm, *serving) for i in range(n)]
        return tuple(torch.stack(list(gs)) for gs in zip(*outs)), (0,) * 8
    f = [_vmap_fold(x) for x in xs]
    grads = torch.ops.flashqla.chunk_bwd(*f[:6], None, f[7], f[8], scale, use_qk_l2norm, *serving)
    out = tuple(x.reshape(n, -1, *x.shape[1:]) for x in grads[:5])
    if h0 is not None:
        out = out + (grads[5].reshape(n, -1, *grads[5].shape[1:]),)
        return out + tuple(grads[6:]), (0,) * 6 + (None, None)
    return out + tuple(grads[5:]), (0, 0, 0, 0, 0, None, None, None)


# ----------------------------------------------------- autograd of chunk_fwd --

def _chunk_setup_context(ctx, inputs, output):
    (q, k, v, g, beta, h0, cu, scale, output_final_state, use_qk_l2norm, *serving) = inputs
    A_log, dt_bias, use_gate, use_sig, state_layout = (serving + [None, None, False, False, "kv"]
                                                       [len(serving):])
    ctx.save_for_backward(q, k, v, g, beta, h0, cu, A_log, dt_bias)
    ctx.scale = scale
    ctx.output_final_state = output_final_state
    ctx.use_qk_l2norm = use_qk_l2norm
    ctx.serving = (bool(use_gate), bool(use_sig), state_layout, len(serving))


def _chunk_backward(ctx, do, dht):
    q, k, v, g, beta, h0, cu, A_log, dt_bias = ctx.saved_tensors
    use_gate, use_sig, state_layout, n_serving = ctx.serving
    if do is None:  # only the final state was used
        do = q.new_zeros((q.shape[0], q.shape[1], v.shape[2], v.shape[3]))
    if not ctx.output_final_state:
        dht = None  # the [0] placeholder has no gradient to give
    with torch.no_grad():  # once differentiable: chunk_bwd has no backward of its own
        dq, dk, dv, dg, dbeta, dh0, dA, ddt = torch.ops.flashqla.chunk_bwd(
            q, k, v, g, beta, h0, cu, do, dht, ctx.scale, ctx.use_qk_l2norm, A_log, dt_bias,
            use_gate, use_sig, state_layout)
    grads = (dq, dk, dv, dg, dbeta, (dh0 if h0 is not None else None), None, None, None, None)
    serving = ((dA if use_gate and A_log is not None else None),
               (ddt if use_gate and dt_bias is not None else None), None, None, None)
    return grads + serving[:n_serving]


# for callers of torch.ops.flashqla.chunk_fwd itself (and torch.library.opcheck)
chunk_fwd.register_autograd(_chunk_backward, setup_context=_chunk_setup_context)


class _ChunkFunction(torch.autograd.Function):
    """The same forward op and backward formula as a torch.autograd.Function
    with setup_context, which the torch.func transforms (torch.func.grad, ...)
    accept; the op's own autograd registration is a Function they do not."""

    @staticmethod
    def forward(q, k, v, g, beta, h0, cu, scale, output_final_state, use_qk_l2norm, A_log, dt_bias,
                use_gate, use_sig, state_layout):
        return torch.ops.flashqla.chunk_fwd(q, k, v, g, beta, h0, cu, scale, output_final_state,
                                            use_qk_l2norm, A_log, dt_bias, use_gate, use_sig,
                                            state_layout)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _chunk_setup_context(ctx, inputs, output)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, do, dht):
        return _chunk_backward(ctx, do, dht)

    @staticmethod
    def vmap(info, in_dims, q, k, v, g, beta, h0, cu, scale, output_final_state, use_qk_l2norm,
             A_log, dt_bias, use_gate, use_sig, state_layout):
        """torch.func.vmap: the mapped axis folded into the batch B (and N),
        one call for the whole vmap; with cu_seqlens (B == 1 packed), one
        call per member."""
        n = info.batch_size
        _vmap_unmapped_params(in_dims, 10)
        serving = (A_log, dt_bias, use_gate, use_sig, state_layout)
        xs = [_vmap_batched(n, x, d) for x, d in zip((q, k, v, g, beta, h0), in_dims[:6])]
        if cu is not None:
            if in_dims[6] is not None:
                raise ValueError("cu_seqlens: torch.func.vmap over cu_seqlens is not supported "
                                 "(pack the sequences into one call instead)")
            outs = [_ChunkFunction.apply(*[None if x is None else x[i] for x in xs], cu, scale,
                                         output_final_state, use_qk_l2norm, *serving)
                    for i in range(n)]
            return (torch.stack([o for o, _ in outs]), torch.stack([h for _, h in outs])), (0, 0)
        o, ht = _ChunkFunction.apply(*[_vmap_fold(x) for x in xs], None, scale,
                                     output_final_state, use_qk_l2norm, *serving)
        o = o.reshape(n, -1, *o.shape[1:])
        if output_final_state:
            return (o, ht.reshape(n, -1, *ht.shape[1:])), (0, 0)
        return (o, ht), (0, None)  # the [0] placeholder is not mapped


# ----------------------------------------------------------------- recurrent --

@torch.library.custom_op("flashqla::recurrent", mutates_args=("state", "intermediate_states"))
def recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
              state_indices: Optional[Tensor], cu_seqlens: Optional[Tensor], scale: float,
              use_qk_l2norm: bool, intermediate_states: Optional[Tensor], update_state: bool,
              state_layout: str, A_log: Optional[Tensor], dt_bias: Optional[Tensor],
              use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool) -> Tensor:
    """Recurrent step: updates the pool `state` [P,HV,K,V] in place (not with
    update_state=False), writes intermediate_states [N,Ti,HV,K,V] if given,
    returns o [B,T,HV,V].

    No argument has a default: the dispatcher drops trailing arguments equal to
    their defaults when it boxes a call for a Python kernel, and the
    ADInplaceOrView step of older PyTorch releases (the H200 image's) then
    indexes the mutated intermediate_states (argument 10) past the end
    (IndexError under opcheck, torch.compile and CUDA graphs).

    Without cu_seqlens (whose CUDA step needs a workspace) and where torch has
    the DLPack C exchange API, the tensors go to the binding themselves, as on
    the eager hot path: what recurrent_prepared does, without its capsules."""
    if _EXCHANGE and cu_seqlens is None:
        use_gate = bool(use_gate_in_kernel)
        o = torch.empty_like(v, memory_format=torch.contiguous_format)  # [B, T, HV, V]
        _C.recurrent(q, k, v, g, beta, state, o, scale=scale, state_indices=state_indices,
                     use_qk_l2norm=bool(use_qk_l2norm), intermediate_states=intermediate_states,
                     update_state=bool(update_state), state_layout=state_layout,
                     use_gate_in_kernel=use_gate, A_log=A_log if use_gate else None,
                     dt_bias=dt_bias if use_gate else None,
                     use_beta_sigmoid_in_kernel=bool(use_beta_sigmoid_in_kernel), exchange_api=True)
        return o
    gates = FusedGates(use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel)
    return recurrent_prepared(TORCH, q, k, v, g, beta, state, state_indices, cu_seqlens, scale,
                              use_qk_l2norm, gates, state_layout, intermediate_states,
                              update_state)


@recurrent.register_fake
def _recurrent_fake(q, k, v, g, beta, state, state_indices, cu_seqlens, scale, use_qk_l2norm,
                    intermediate_states, update_state, state_layout, A_log, dt_bias,
                    use_gate_in_kernel, use_beta_sigmoid_in_kernel):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2], v.shape[3]))


# ------------------------------------------------ serving: pool, checkpoints --

@torch.library.custom_op("flashqla::chunk_fwd_serving", mutates_args=("state",))
def chunk_fwd_serving(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                      initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
                      state: Optional[Tensor], state_indices: Optional[Tensor], scale: float,
                      output_final_state: bool, use_qk_l2norm: bool, A_log: Optional[Tensor],
                      dt_bias: Optional[Tensor], use_gate_in_kernel: bool,
                      use_beta_sigmoid_in_kernel: bool, state_layout: str,
                      checkpoint_every: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The forward-only chunk forward: pool-indexed prefill (state, state_indices:
    the pool read and written in place) and/or checkpoints every
    checkpoint_every tokens. (o, final_state, checkpoints, cu_checkpoints), [0]
    placeholders for what was not asked for."""
    gates = FusedGates(use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel)
    res = chunk_fwd_prepared(TORCH, q, k, v, g, beta, initial_state, cu_seqlens, scale,
                             output_final_state, use_qk_l2norm, gates, state_layout, state,
                             state_indices, checkpoint_every)
    empty = q.new_empty((0,), dtype=_state_dtype(q.dtype))
    o, ht = res[0], (res[1] if res[1] is not None else empty)
    if checkpoint_every:
        return o, ht, res[2][0], res[2][1]
    return o, ht, empty.clone(), q.new_empty((0,), dtype=torch.int64)


@chunk_fwd_serving.register_fake
def _chunk_fwd_serving_fake(q, k, v, g, beta, initial_state, cu_seqlens, state, state_indices,
                            scale, output_final_state, use_qk_l2norm, A_log, dt_bias,
                            use_gate_in_kernel, use_beta_sigmoid_in_kernel, state_layout,
                            checkpoint_every):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = _num_sequences(q, cu_seqlens)
    sd = state_dims(K, V, state_layout)
    ht = q.new_empty((N, HV) + sd if output_final_state else (0,), dtype=_state_dtype(q.dtype))
    if checkpoint_every:
        ck = q.new_empty((B * (T // checkpoint_every), HV) + sd, dtype=_state_dtype(q.dtype))
        cuck = q.new_empty((N + 1,), dtype=torch.int64)
    else:
        ck = q.new_empty((0,), dtype=_state_dtype(q.dtype))
        cuck = q.new_empty((0,), dtype=torch.int64)
    return q.new_empty((B, T, HV, V)), ht, ck, cuck


@torch.library.custom_op("flashqla::commit", mutates_args=("state",))
def commit(state: Tensor, intermediate_states: Tensor, state_indices: Optional[Tensor],
           num_accepted: Tensor, state_layout: str) -> None:
    """state[state_indices[n]] = intermediate_states[n, num_accepted[n] - 1]
    (num_accepted[n] > 0, slot >= 0), in place."""
    commit_prepared(TORCH, state, intermediate_states, state_indices, num_accepted, state_layout)


@commit.register_fake
def _commit_fake(state, intermediate_states, state_indices, num_accepted, state_layout):
    return None


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


def _checked_dims(state_layout):
    return "[N, HV, K, V]" if state_layout == "kv" else "[N, HV, V, K]"


def gdn_chunk(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, use_qk_l2norm=False, state=None, state_indices=None,
              checkpoint_every=None, state_layout="kv", use_gate_in_kernel=False, A_log=None,
              dt_bias=None, use_beta_sigmoid_in_kernel=False):
    """flashqla.gdn_chunk for PyTorch tensors, through torch.ops.flashqla.chunk_fwd
    (or chunk_fwd_serving for the pool and checkpoints, forward only)."""
    _check_ndim(q, "q", 4, "[B, T, H, K]")
    _check_ndim(k, "k", 4, "[B, T, H, K]")
    _check_ndim(v, "v", 4, "[B, T, HV, V]")
    _check_ndim(g, "g", 3, "[B, T, HV]")
    _check_ndim(beta, "beta", 3, "[B, T, HV]")
    _check_ndim(initial_state, "initial_state", 4, _checked_dims(state_layout))
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta = _gates(q, g.contiguous(), beta.contiguous())
    h0 = _state(initial_state, q)
    cu = _index(cu_seqlens, q, "cu_seqlens")
    _check_ndim(cu, "cu_seqlens", 1, "[N + 1]")
    A, dtb = prepare_gate_params(TORCH, q, use_gate_in_kernel, A_log, dt_bias)
    scale = scale_of(scale, q)
    use_gate, use_sig = bool(use_gate_in_kernel), bool(use_beta_sigmoid_in_kernel)
    grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, h0, A, dtb))
    if state is not None or checkpoint_every is not None:
        if grad:
            raise ValueError("state, checkpoint_every: pool-indexed prefill and checkpoints are "
                             "forward only; call under torch.no_grad() or with tensors that do "
                             "not require grad")
        _check_ndim(state, "state", 4, _checked_dims(state_layout).replace("N", "P"))
        idx = _index(state_indices, q, "state_indices")
        _check_ndim(idx, "state_indices", 1, "[N]")
        o, ht, ck, cuck = torch.ops.flashqla.chunk_fwd_serving(
            q, k, v, g, beta, h0, cu, state, idx, scale, bool(output_final_state),
            bool(use_qk_l2norm), A, dtb, use_gate, use_sig, state_layout, int(checkpoint_every or 0))
        ht = ht if output_final_state else None
        return (o, ht, (ck, cuck)) if checkpoint_every else (o, ht)
    args = (q, k, v, g, beta, h0, cu, scale, bool(output_final_state), bool(use_qk_l2norm), A, dtb,
            use_gate, use_sig, state_layout)
    if grad or torch._C._are_functorch_transforms_active():
        o, ht = _ChunkFunction.apply(*args)  # autograd, torch.func (grad, vmap)
    else:
        o, ht = torch.ops.flashqla.chunk_fwd(*args)
    return o, (ht if output_final_state else None)


def gdn_recurrent(q, k, v, g, beta, state, *, state_indices=None, scale=None, cu_seqlens=None,
                  use_qk_l2norm=False, intermediate_states=None, update_state=True,
                  state_layout="kv", use_gate_in_kernel=False, A_log=None, dt_bias=None,
                  use_beta_sigmoid_in_kernel=False):
    """flashqla.gdn_recurrent for PyTorch tensors, through torch.ops.flashqla.recurrent
    (no gradients: the inputs are detached; the pool is updated in place)."""
    return recurrent_call(q, k, v, g, beta, state, state_indices, scale, cu_seqlens, use_qk_l2norm,
                          intermediate_states, update_state, state_layout, use_gate_in_kernel,
                          A_log, dt_bias, use_beta_sigmoid_in_kernel)


def recurrent_call(q, k, v, g, beta, state, state_indices, scale, cu_seqlens, use_qk_l2norm,
                   intermediate_states, update_state, state_layout, use_gate_in_kernel, A_log,
                   dt_bias, use_beta_sigmoid_in_kernel):
    """gdn_recurrent with its arguments in order (positional arguments cost ~0.5 us
    less per decode step than keywords): the hot path (recurrent_hot_entry) when
    the call is of its kind, else the checked path. (flashqla.gdn_recurrent tries
    the hot path itself, then calls recurrent_checked.)"""
    if (cu_seqlens is None and not use_gate_in_kernel and not use_beta_sigmoid_in_kernel
            and not _is_compiling()):
        o = recurrent_hot_entry(q, k, v, g, beta, state, state_indices, scale, use_qk_l2norm,
                                intermediate_states, update_state, state_layout)
        if o is not None:
            return o
    return recurrent_checked(q, k, v, g, beta, state, state_indices, scale, cu_seqlens,
                             use_qk_l2norm, intermediate_states, update_state, state_layout,
                             use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel)


def recurrent_checked(q, k, v, g, beta, state, state_indices, scale, cu_seqlens, use_qk_l2norm,
                      intermediate_states, update_state, state_layout, use_gate_in_kernel, A_log,
                      dt_bias, use_beta_sigmoid_in_kernel):
    """The checked path of gdn_recurrent (arguments in order): every check and
    preparation in Python, then the op (or its kernel when nothing traces)."""
    _check_ndim(q, "q", 4, "[B, T, H, K]")
    _check_ndim(k, "k", 4, "[B, T, H, K]")
    _check_ndim(v, "v", 4, "[B, T, HV, V]")
    _check_ndim(g, "g", 3, "[B, T, HV]")
    _check_ndim(beta, "beta", 3, "[B, T, HV]")
    _check_ndim(state, "state", 4, _checked_dims(state_layout).replace("N", "P"))
    _check_ndim(intermediate_states, "intermediate_states", 5,
                "[N, Ti, HV, K, V]" if state_layout == "kv" else "[N, Ti, HV, V, K]")
    q, k, v, g, beta, state = (x.detach() if x.requires_grad else x for x in (q, k, v, g, beta, state))
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta = _gates(q, g.contiguous(), beta.contiguous())
    idx = _index(state_indices, q, "state_indices")
    _check_ndim(idx, "state_indices", 1, "[N]")
    cu = _index(cu_seqlens, q, "cu_seqlens")
    _check_ndim(cu, "cu_seqlens", 1, "[N + 1]")
    A, dtb = prepare_gate_params(TORCH, q, use_gate_in_kernel, A_log, dt_bias)
    if A is not None:
        A, dtb = A.detach(), (None if dtb is None else dtb.detach())
    scale = scale_of(scale, q)
    inter = intermediate_states
    serving = (inter, bool(update_state), state_layout, A, dtb, bool(use_gate_in_kernel),
               bool(use_beta_sigmoid_in_kernel))
    if _plain_eager(q, k, v, g, beta, state, idx, cu, inter, A, dtb):
        # the op's own kernel, without the ~10 us of the dispatcher's Python
        # custom-op machinery: decoding calls this once per layer and token
        gates = (FusedGates(use_gate_in_kernel, A, dtb, use_beta_sigmoid_in_kernel)
                 if use_gate_in_kernel or use_beta_sigmoid_in_kernel else NO_GATES)
        o = recurrent_prepared(TORCH, q, k, v, g, beta, state, idx, cu, scale,
                               bool(use_qk_l2norm), gates, state_layout, inter,
                               bool(update_state))
        _written(state, inter, update_state)
        return o
    return torch.ops.flashqla.recurrent(q, k, v, g, beta, state, idx, cu, scale,
                                        bool(use_qk_l2norm), *serving)


def gdn_commit(state, intermediate_states, state_indices, num_accepted, *, state_layout="kv"):
    """flashqla.gdn_commit for PyTorch tensors, through torch.ops.flashqla.commit."""
    check_layout(state_layout)
    _check_ndim(state, "state", 4, _checked_dims(state_layout).replace("N", "P"))
    _check_ndim(intermediate_states, "intermediate_states", 5,
                "[N, Ti, HV, K, V]" if state_layout == "kv" else "[N, Ti, HV, V, K]")
    if num_accepted is None:
        raise TypeError("num_accepted: expected an int32/int64 array [N], got None")
    idx = _index(state_indices, state, "state_indices")
    acc = _index(num_accepted, state, "num_accepted")
    _check_ndim(idx, "state_indices", 1, "[N]")
    _check_ndim(acc, "num_accepted", 1, "[N]")
    if _plain_eager(state, intermediate_states, idx, acc):
        commit_prepared(TORCH, state, intermediate_states, idx, acc, state_layout)
        _increment_version((state,))  # as the op's ADInplaceOrView kernel
    else:
        torch.ops.flashqla.commit(state, intermediate_states, idx, acc, state_layout)


def recurrent_hot(q, k, v, g, beta, state, idx, scale, use_qk_l2norm, inter=None,
                  update_state=True, state_layout="kv"):
    """The hot path of gdn_recurrent without cu_seqlens and fused gates: the
    decode step (one call per layer and token) and the speculative verify
    (intermediate_states, update_state=False), either state layout. When
    nothing needs preparing (plain tensors that do not require grad, gates
    already float32 or q's dtype, indices on q's device) and nothing traces
    the call (see _plain_eager), the op's kernel is called with no Python
    checks of its own: the binding checks every argument (contiguity
    included) before it does anything, and an argument it refuses sends the
    call down the full path, which makes inputs contiguous or raises its own
    error naming the argument. scale None or a float goes to the binding as
    it came (None: K ** -0.5 there, the same double). The tensors go to the
    binding themselves, taken there through torch's DLPack C exchange API
    (exchange_api=True: what a to_dlpack capsule held, without making one),
    which on CUDA also gives torch's current stream; a torch without that API
    gets capsules and the stream as a raw int. No workspace (the step needs
    one only with cu_seqlens). Returns None when the call is not of that kind
    (gdn_recurrent then takes the full path). Where torch has the exchange API
    gdn_recurrent calls _C.recurrent_hot instead (recurrent_hot_entry below):
    these decisions made in C, except that a scale that is not a float goes to
    the full path there; keep the two in step."""
    T = Tensor  # type() first: it runs no torch function mode
    if not (type(q) is T and type(k) is T and type(v) is T and type(g) is T and type(beta) is T
            and type(state) is T):
        return None
    if not _plain_eager():
        return None
    if (q.requires_grad or k.requires_grad or v.requires_grad or g.requires_grad or
            beta.requires_grad or state.requires_grad):
        return None
    gd = g.dtype                                               # (dtypes are singletons)
    if gd is not beta.dtype or (gd is not _F32 and gd is not q.dtype):
        return None
    dev = q.get_device()                                       # -1 on the CPU
    if idx is not None and (type(idx) is not T or idx.get_device() != dev):
        return None
    serving = not (inter is None and update_state is True and state_layout == "kv")
    if serving:                                                # verify, the [V, K] layout
        if not ((update_state is True or update_state is False) and
                (state_layout == "kv" or state_layout == "vk")):
            return None
        if inter is not None and (type(inter) is not T or inter.requires_grad):
            return None
    if scale is not None and type(scale) is not float:
        scale = scale_of(scale, q)  # (None: the binding's K ** -0.5, the same double)
    o = torch.empty_like(v)                                    # [B, T, HV, V]
    try:
        if _EXCHANGE:
            if serving:
                _C.recurrent(q, k, v, g, beta, state, o, scale=scale, state_indices=idx,
                             use_qk_l2norm=use_qk_l2norm, intermediate_states=inter,
                             update_state=update_state, state_layout=state_layout,
                             exchange_api=True)
            else:
                _C.recurrent(q, k, v, g, beta, state, o, scale=scale, state_indices=idx,
                             use_qk_l2norm=use_qk_l2norm, exchange_api=True)
        else:
            c = _to_dlpack
            kw = {}                                            # decode: the defaults
            if serving:
                kw = {"intermediate_states": None if inter is None else c(inter),
                      "update_state": update_state, "state_layout": state_layout}
            if idx is not None:
                kw["state_indices"] = c(idx)
            if use_qk_l2norm:
                kw["use_qk_l2norm"] = True
            if dev >= 0:
                kw["stream"] = TORCH.cuda_stream(dev)
            _C.recurrent(c(q), c(k), c(v), c(g), c(beta), c(state), c(o), scale=scale, **kw)
    except (ValueError, TypeError):
        # the binding refused an argument before doing anything (a non-contiguous
        # array, or a bad one): the checked path makes the inputs contiguous, or
        # raises its own error naming the argument
        return None
    _written(state, inter, update_state)
    return o


def _written(state, inter, update_state):
    """Bumps the autograd version counters of what a recurrent step wrote in
    place (as the op's ADInplaceOrView kernel does), so that autograd refuses
    a backward through a saved copy of the pool instead of using the new
    values silently."""
    if inter is None:
        if update_state:
            _increment_version((state,))
    else:
        _increment_version((state, inter) if update_state else (inter,))


# torch.Tensor carries the DLPack C exchange API (DLPack 1.3) that the binding
# takes tensors through: no capsule per array, the CUDA stream read in C
_EXCHANGE = bool(_C.exchange_api(Tensor))
_F32 = torch.float32
_increment_version = torch._C._increment_version  # what torch.autograd.graph.increment_version calls


def commit_hot(state, inter, idx, acc, state_layout):
    """The hot path of gdn_commit (one call per verify step): plain tensors,
    nothing tracing (_plain_eager), indices on the pool's device and a layout
    the binding takes; the binding, handed the tensors themselves (exchange_api,
    as recurrent_hot), checks everything else, and an argument it refuses
    sends the call down the checked path (which converts lists, moves indices
    and raises its own errors). True when the commit was made."""
    T = Tensor
    if not (_EXCHANGE and type(state) is T and type(inter) is T and type(acc) is T and
            (idx is None or type(idx) is T)):
        return False
    if not _plain_eager():
        return False
    dev = state.get_device()
    if acc.get_device() != dev or (idx is not None and idx.get_device() != dev):
        return False
    if state_layout != "kv" and state_layout != "vk":
        return False
    try:
        _C.commit(state, inter, acc, state_indices=idx, state_layout=state_layout,
                  exchange_api=True)
    except (ValueError, TypeError):
        return False  # nothing was written: the checked path raises its own error
    _increment_version((state,))  # as the op's ADInplaceOrView kernel
    return True


def _plain_eager(*tensors):
    """True when calling an op's kernel directly is the same as calling the op:
    eager mode (no torch.compile tracing), no torch.func transform, no
    dispatch or function mode (make_fx, FakeTensorMode, a TorchFunctionMode,
    ...) and plain torch.Tensor arguments (no subclass: FakeTensor, DTensor)."""
    if (_is_compiling() or _functorch_active() or _len_dispatch_modes() or
            _len_function_modes()):
        return False
    for x in tensors:  # (a loop: no generator object made per decode step)
        if x is not None and type(x) is not Tensor:
            return False
    return True


# looked up once (the decode step calls _plain_eager per layer and token); the
# same function objects, so torch.compile still sees torch.compiler.is_compiling
_is_compiling = torch.compiler.is_compiling
_functorch_active = torch._C._are_functorch_transforms_active
_len_dispatch_modes = torch._C._len_torch_dispatch_stack
_len_function_modes = torch._C._len_torch_function_stack
is_compiling = _is_compiling  # (flashqla._api checks it before recurrent_hot_entry)

# The decode hot path gdn_recurrent tries first: where torch has the DLPack C
# exchange API, recurrent_hot's checks and calls made in C (_C.recurrent_hot:
# the same decisions, the same call, no Python frame; its caller checks
# is_compiling), else recurrent_hot itself.
if _EXCHANGE:
    _C.recurrent_hot_init(Tensor, _F32, torch.empty_like, _functorch_active, _len_dispatch_modes,
                          _len_function_modes, _increment_version)
    recurrent_hot_entry = _C.recurrent_hot
else:
    recurrent_hot_entry = recurrent_hot

