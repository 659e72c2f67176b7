"""The public functions of flashqla (re-exported by flashqla/__init__.py).

Shapes (time-major, as in FLA):

    q, k           [B, T, H, K]      float32 / float16 / bfloat16 / float64
    v, o           [B, T, HV, V]     same dtype as q (HV a multiple of H)
    g, beta        [B, T, HV]        float32 or q's dtype; g <= 0 is a log decay,
                                     beta in (0, 1)
    initial_state  [N, HV, K, V]     float32 (float64 with float64 inputs)
    cu_seqlens     [N + 1]           int32 / int64, packed sequences, B == 1

Every function takes NumPy arrays, PyTorch tensors (CPU or CUDA), JAX arrays or
CuPy arrays and returns arrays of the same framework, allocated by that
framework (JAX: by flashqla, handed over through DLPack). The work runs in the
C backend (flashqla._C): the CPU backend for host arrays, the CUDA backend for
device arrays, on the caller's current stream.
"""

from . import _C
from ._frameworks import JAX, TORCH, common_framework, state_dtype_of

__all__ = ["gdn_chunk", "gdn_chunk_fwd", "gdn_chunk_bwd", "gdn_recurrent",
           "chunk_gated_delta_rule", "ChunkContext"]


# ------------------------------------------------------------ preparation ----

def _check_ndim(x, name, ndim, layout):
    if x is not None and getattr(x, "ndim", None) != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions {layout}, "
                         f"got shape {list(getattr(x, 'shape', ()))}")


def _prepare_gates(fw, q, g, beta):
    """g and beta go to the C core unchanged when they share one dtype that is
    float32 or q's dtype; otherwise both are cast to float32 (gradients are
    cast back). Non-float gates are passed on for the core to reject."""
    gd, bd, qd = fw.dtype_name(g), fw.dtype_name(beta), fw.dtype_name(q)
    if gd == bd and gd in ("float32", qd):
        return g, beta
    if fw.is_floating(g) and fw.is_floating(beta):
        return fw.astype(g, "float32"), fw.astype(beta, "float32")
    return g, beta


def _prepare_state(fw, x, q):
    """The state in the core's dtype: float32, or float64 with float64 inputs."""
    if x is None:
        return None
    x = fw.contiguous(x)
    want = state_dtype_of(fw.dtype_name(q))
    if fw.is_floating(x) and fw.dtype_name(x) != want:
        x = fw.astype(x, want)
    return x


def _prepare_inputs(q, k, v, g, beta, initial_state, cu_seqlens):
    fw = common_framework([("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta),
                           ("initial_state", initial_state)])
    _check_ndim(q, "q", 4, "[B, T, H, K]")
    _check_ndim(k, "k", 4, "[B, T, H, K]")
    _check_ndim(v, "v", 4, "[B, T, HV, V]")
    _check_ndim(g, "g", 3, "[B, T, HV]")
    _check_ndim(beta, "beta", 3, "[B, T, HV]")
    _check_ndim(initial_state, "initial_state", 4, "[N, HV, K, V]")
    q, k, v, g, beta = (fw.contiguous(x) for x in (q, k, v, g, beta))
    g, beta = _prepare_gates(fw, q, g, beta)
    h0 = _prepare_state(fw, initial_state, q)
    cu = None
    if cu_seqlens is not None:
        cu = fw.index_array(cu_seqlens, q, "cu_seqlens")
        _check_ndim(cu, "cu_seqlens", 1, "[N + 1]")
    return fw, q, k, v, g, beta, h0, cu


def _sizes(q, v, cu):
    B, T, H, K = (int(s) for s in q.shape)
    HV, V = int(v.shape[2]), int(v.shape[3])
    N = B if cu is None else max(int(cu.shape[0]) - 1, 0)
    return B, T, H, HV, K, V, N


def _scale(scale, q):
    return float(q.shape[-1]) ** -0.5 if scale is None else float(scale)


# --------------------------------------------------------------- raw calls ----
# Inputs already prepared (contiguous, dtypes settled); outputs allocated here.

def _detached(fw, *xs):
    return tuple(None if x is None else fw.detach(x) for x in xs)


def chunk_fwd_prepared(fw, q, k, v, g, beta, h0, cu, scale, output_final_state,
                       use_qk_l2norm):
    q, k, v, g, beta, h0, cu = _detached(fw, q, k, v, g, beta, h0, cu)
    B, T, H, HV, K, V, N = sizes = _sizes(q, v, cu)
    dt = fw.dtype_name(q)
    o = fw.empty((B, T, HV, V), dt, q)
    ht = fw.empty((N, HV, K, V), state_dtype_of(dt), q) if output_final_state else None
    launch = fw.launch("fwd", q, sizes, dt)
    fw.before_call((q, k, v, g, beta, h0, cu))
    _C.chunk_fwd(q, k, v, g, beta, o, scale=scale, initial_state=h0, final_state=ht,
                 cu_seqlens=cu, use_qk_l2norm=bool(use_qk_l2norm), **launch)
    fw.after_call(q)
    return fw.output(o), fw.output(ht)


def chunk_bwd_prepared(fw, q, k, v, g, beta, h0, cu, scale, use_qk_l2norm, do, dht):
    q, k, v, g, beta, h0, cu, do, dht = _detached(fw, q, k, v, g, beta, h0, cu, do, dht)
    B, T, H, HV, K, V, N = sizes = _sizes(q, v, cu)
    dt = fw.dtype_name(q)
    do = fw.contiguous(do)
    if fw.dtype_name(do) != dt and fw.is_floating(do):
        do = fw.astype(do, dt)
    dht = _prepare_state(fw, dht, q)
    dq = fw.empty(tuple(q.shape), dt, q)
    dk = fw.empty(tuple(k.shape), fw.dtype_name(k), q)
    dv = fw.empty(tuple(v.shape), fw.dtype_name(v), q)
    dg = fw.empty(tuple(g.shape), fw.dtype_name(g), q)
    dbeta = fw.empty(tuple(beta.shape), fw.dtype_name(beta), q)
    dh0 = None if h0 is None else fw.empty(tuple(h0.shape), fw.dtype_name(h0), q)
    launch = fw.launch("bwd", q, sizes, dt)
    fw.before_call((q, k, v, g, beta, h0, cu, do, dht))
    _C.chunk_bwd(q, k, v, g, beta, do, dq, dk, dv, dg, dbeta, scale=scale,
                 initial_state=h0, dfinal_state=dht, dinitial_state=dh0, cu_seqlens=cu,
                 use_qk_l2norm=bool(use_qk_l2norm), **launch)
    fw.after_call(q)
    return tuple(fw.output(x) for x in (dq, dk, dv, dg, dbeta, dh0))


# ---------------------------------------------------------- public: chunk ----

class ChunkContext:
    """What gdn_chunk_bwd needs from gdn_chunk_fwd: the (prepared) inputs and
    options. Nothing computed in the forward is kept: the backward recomputes
    it from the inputs."""

    __slots__ = ("framework", "inputs", "scale", "use_qk_l2norm", "grad_dtypes")

    def __init__(self, framework, inputs, scale, use_qk_l2norm, grad_dtypes):
        self.framework = framework
        self.inputs = inputs              # q, k, v, g, beta, h0, cu_seqlens
        self.scale = scale
        self.use_qk_l2norm = use_qk_l2norm
        self.grad_dtypes = grad_dtypes    # caller's dtypes of g, beta, initial_state

    def __repr__(self):
        q = self.inputs[0]
        return (f"ChunkContext({self.framework.name}, q{list(q.shape)} "
                f"{self.framework.dtype_name(q)}, scale={self.scale:g}, "
                f"use_qk_l2norm={self.use_qk_l2norm})")


def gdn_chunk_fwd(q, k, v, g, beta, *, scale=None, initial_state=None,
                  output_final_state=False, cu_seqlens=None, use_qk_l2norm=False):
    """Chunked forward of the gated delta rule without autograd.

    Returns (o, final_state, ctx): final_state [N, HV, K, V] is None unless
    output_final_state; ctx goes to gdn_chunk_bwd. Works for every framework;
    the autograd wrappers (PyTorch, JAX) are built on this pair."""
    grad_dtypes = None
    fw = common_framework([("q", q), ("g", g), ("beta", beta), ("initial_state", initial_state)])
    if fw is not None:
        grad_dtypes = tuple(None if x is None else fw.dtype_name(x)
                            for x in (g, beta, initial_state))
    if fw is TORCH:
        q, k, v, g, beta, initial_state = _detached(fw, q, k, v, g, beta, initial_state)
    fw, q, k, v, g, beta, h0, cu = _prepare_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    scale = _scale(scale, q)
    o, ht = chunk_fwd_prepared(fw, q, k, v, g, beta, h0, cu, scale, output_final_state,
                               use_qk_l2norm)
    ctx = ChunkContext(fw, (q, k, v, g, beta, h0, cu), scale, bool(use_qk_l2norm), grad_dtypes)
    return o, ht, ctx


def gdn_chunk_bwd(ctx, do, dfinal_state=None):
    """Backward of gdn_chunk_fwd: from do [B, T, HV, V] (and dfinal_state
    [N, HV, K, V], None meaning zero) returns (dq, dk, dv, dg, dbeta,
    dinitial_state), each in the dtype of its input; dinitial_state is None
    when no initial state was given."""
    if not isinstance(ctx, ChunkContext):
        raise TypeError(f"ctx: expected the ChunkContext returned by gdn_chunk_fwd, "
                        f"got {type(ctx).__name__}")
    fw = ctx.framework
    if do is None:
        raise TypeError("do: the gradient of o is required (zeros if o is unused)")
    dfw = common_framework([("do", do), ("dfinal_state", dfinal_state)])
    if dfw is not fw:
        raise TypeError(f"do: is a {dfw.name} array but the forward ran on {fw.name} arrays")
    q, k, v, g, beta, h0, cu = ctx.inputs
    grads = chunk_bwd_prepared(fw, q, k, v, g, beta, h0, cu, ctx.scale, ctx.use_qk_l2norm,
                               do, dfinal_state)
    dq, dk, dv, dg, dbeta, dh0 = grads
    back = []
    for grad, want in zip((dg, dbeta, dh0), ctx.grad_dtypes):
        if grad is not None and want is not None and fw.dtype_name(grad) != want:
            grad = fw.astype(grad, want)
        back.append(grad)
    return (dq, dk, dv) + tuple(back)


def gdn_chunk(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, use_qk_l2norm=False):
    """Gated delta rule, chunked (prefill / training). Returns (o, final_state).

    o [B, T, HV, V] in q's dtype; final_state [N, HV, K, V] (float32, float64
    with float64 inputs) or None unless output_final_state. scale defaults to
    K ** -0.5. With PyTorch tensors that require grad, gradients flow to q, k,
    v, g, beta and initial_state (torch.autograd.Function); with JAX arrays,
    jax.grad works (flashqla.jax.gdn_chunk, a jax.custom_vjp)."""
    fw = common_framework([("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta),
                           ("initial_state", initial_state)], check=False)
    if fw is JAX:  # (JAX tracers are checked inside, where jax.grad hands over values)
        from . import jax as fq_jax
        return fq_jax.gdn_chunk(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                output_final_state=output_final_state,
                                cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm)
    fw, q, k, v, g, beta, h0, cu = _prepare_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    scale = _scale(scale, q)
    if fw is TORCH:
        import torch
        if torch.is_grad_enabled() and any(
                x is not None and x.requires_grad for x in (q, k, v, g, beta, h0)):
            from ._torch import ChunkFunction
            return ChunkFunction.apply(q, k, v, g, beta, h0, cu, scale,
                                       bool(output_final_state), bool(use_qk_l2norm))
    return chunk_fwd_prepared(fw, q, k, v, g, beta, h0, cu, scale, output_final_state,
                              use_qk_l2norm)


# ------------------------------------------------------ public: recurrent ----

def gdn_recurrent(q, k, v, g, beta, state, *, state_indices=None, scale=None,
                  cu_seqlens=None, use_qk_l2norm=False):
    """Recurrent step (decode / multi-token verify) against a state pool.

    state [P, HV, K, V] (float32; float64 with float64 inputs) is read and
    updated in place: sequence n (row n of the batch, or cu_seqlens[n] ..
    cu_seqlens[n+1]-1) starts from slot state_indices[n] (slot n without
    indices) and leaves its final state there; a negative slot is padding (the
    sequence is skipped, its o rows are 0). Returns o [B, T, HV, V]. No
    gradients. JAX arrays are immutable: use flashqla.jax.gdn_recurrent."""
    fw = common_framework([("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta),
                           ("state", state)])
    if fw is JAX:
        raise TypeError("state: JAX arrays cannot be updated in place; use "
                        "flashqla.jax.gdn_recurrent, which returns (o, new_state)")
    _check_ndim(state, "state", 4, "[P, HV, K, V]")
    if fw is TORCH:
        q, k, v, g, beta, state = _detached(fw, q, k, v, g, beta, state)
    fw, q, k, v, g, beta, _, cu = _prepare_inputs(q, k, v, g, beta, None, cu_seqlens)
    idx = None
    if state_indices is not None:
        idx = fw.index_array(state_indices, q, "state_indices")
        _check_ndim(idx, "state_indices", 1, "[N]")
    return recurrent_prepared(fw, q, k, v, g, beta, state, idx, cu, _scale(scale, q),
                              use_qk_l2norm)


def recurrent_prepared(fw, q, k, v, g, beta, state, idx, cu, scale, use_qk_l2norm):
    q, k, v, g, beta, state, idx, cu = _detached(fw, q, k, v, g, beta, state, idx, cu)
    B, T, H, HV, K, V, N = sizes = _sizes(q, v, cu)
    dt = fw.dtype_name(q)
    o = fw.empty((B, T, HV, V), dt, q)
    launch = fw.launch("recurrent", q, sizes, dt)
    fw.before_call((q, k, v, g, beta, state, idx, cu))
    _C.recurrent(q, k, v, g, beta, state, o, scale=scale, state_indices=idx, cu_seqlens=cu,
                 use_qk_l2norm=bool(use_qk_l2norm), **launch)
    fw.after_call(q)
    return fw.output(o)


# ------------------------------------------------------ public: FLA names ----

# FLA keyword arguments that only steer how FLA computes (hints, caches,
# its own graph / context-parallel machinery): accepted and ignored.
_FLA_HINTS = ("cu_seqlens_cpu", "chunk_indices", "auto_cp", "enable_fwd_cp_cache", "use_graph")
# FLA keyword arguments that change the operator: accepted only at their default.
_FLA_DEFAULT_ONLY = {
    "head_first": False,
    "use_beta_sigmoid_in_kernel": False,
    "allow_neg_eigval": False,
    "state_v_first": False,
    "transpose_state_layout": False,
    "cp_context": None,
}


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False,
                           cu_seqlens=None, **kwargs):
    """FLA's `fla.ops.gated_delta_rule.chunk_gated_delta_rule`, same
    arguments in the same order, so FLA code runs unchanged:
    `from flashqla import chunk_gated_delta_rule`. Returns (o, final_state).

    FLA's optional keywords that only steer FLA's own machinery
    (cu_seqlens_cpu, chunk_indices, ...) are ignored; those that change the
    operator (head_first=True, use_beta_sigmoid_in_kernel=True, ...) raise
    ValueError; anything else raises TypeError like any unknown keyword."""
    for name, value in kwargs.items():
        if name in _FLA_HINTS:
            continue
        if name in _FLA_DEFAULT_ONLY:
            default = _FLA_DEFAULT_ONLY[name]
            if value is default or value == default:
                continue
            raise ValueError(f"chunk_gated_delta_rule: {name}={value!r} is not supported by "
                             f"flashqla (only {name}={default!r})")
        raise TypeError(f"chunk_gated_delta_rule() got an unexpected keyword argument {name!r}")
    return gdn_chunk(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                     use_qk_l2norm=use_qk_l2norm_in_kernel)
