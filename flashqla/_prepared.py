"""The bottom layer of flashqla's Python side: prepared calls and contexts.

Everything here takes arrays of one framework (an adapter of _frameworks.py)
and calls the C backend (flashqla._C): argument preparation (contiguous
copies, dtype casts of gates and states, index arrays), output allocation in
the caller's framework, the three raw calls, and the framework-neutral
forward/backward pair with the ChunkContext that links them.

Imports run one way (DESIGN §4): the public API (_api.py) and the framework
front-ends (_torch.py, jax.py) call down into this module; it imports only
_C and _frameworks, never anything above it.

Shapes (time-major, as in FLA):

    q, k           [B, T, H, K]      float32 / float16 / bfloat16 / float64
    v, o           [B, T, HV, V]     same dtype as q (HV a multiple of H)
    g, beta        [B, T, HV]        float32 or q's dtype
    initial_state  [N, HV, K, V]     float32 (float64 with float64 inputs)
    state          [P, HV, K, V]     the recurrent step's pool, same dtype
    cu_seqlens     [N + 1]           int32 / int64, packed sequences, B == 1

Every state (initial/final, pools, intermediate states, checkpoints) ends in
[K, V], or in [V, K] with state_layout="vk". With fused gates (FusedGates) the
g and beta arguments hold the raw a and b.
"""

from . import _C
from ._frameworks import (TORCH, check_float_dtypes, common_framework, public_arrays, scale_of,
                          state_dtype_of)


# ------------------------------------------------------------ preparation ----

def check_ndim(x, name, ndim, layout):
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


def prepare_state(fw, x, q):
    """The state in the core's dtype: float32, or float64 with float64 inputs."""
    if x is None:
        return None
    x = fw.contiguous(x)
    want = state_dtype_of(fw.dtype_name(q))
    if fw.is_floating(x) and fw.dtype_name(x) != want:
        x = fw.astype(x, want)
    return x


def prepare_inputs(q, k, v, g, beta, initial_state, cu_seqlens):
    fw = common_framework([("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta),
                           ("initial_state", initial_state)])
    check_ndim(q, "q", 4, "[B, T, H, K]")
    check_ndim(k, "k", 4, "[B, T, H, K]")
    check_ndim(v, "v", 4, "[B, T, HV, V]")
    check_ndim(g, "g", 3, "[B, T, HV]")
    check_ndim(beta, "beta", 3, "[B, T, HV]")
    check_ndim(initial_state, "initial_state", 4, "[N, HV, K, V]")
    check_float_dtypes(fw, [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta),
                            ("initial_state", initial_state)])
    q, k, v, g, beta = (fw.contiguous(x) for x in (q, k, v, g, beta))
    g, beta = _prepare_gates(fw, q, g, beta)
    h0 = prepare_state(fw, initial_state, q)
    cu = None
    if cu_seqlens is not None:
        cu = fw.index_array(cu_seqlens, q, "cu_seqlens")
        check_ndim(cu, "cu_seqlens", 1, "[N + 1]")
    return fw, q, k, v, g, beta, h0, cu


LAYOUTS = ("kv", "vk")


def check_layout(state_layout):
    if state_layout not in LAYOUTS:
        raise ValueError(f"state_layout: expected \"kv\" (states [.., K, V]) or \"vk\" "
                         f"([.., V, K]), got {state_layout!r}")
    return state_layout


def state_dims(K, V, state_layout):
    """The last two dimensions of a state in this layout."""
    return (V, K) if state_layout == "vk" else (K, V)


class FusedGates:
    """FLA's fused gates: use_gate_in_kernel (g holds a; the operator uses
    g = -exp(A_log) softplus(a + dt_bias)) and use_beta_sigmoid_in_kernel
    (beta holds b; the operator uses sigmoid(b)), with A_log, dt_bias [HV]
    prepared (contiguous, float32; float64 with float64 inputs)."""

    __slots__ = ("use_gate", "A_log", "dt_bias", "use_sig")

    def __init__(self, use_gate, A_log, dt_bias, use_sig):
        self.use_gate = bool(use_gate)
        self.A_log = A_log if use_gate else None
        self.dt_bias = dt_bias if use_gate else None
        self.use_sig = bool(use_sig)

    def kwargs(self, fw):
        """The _C keywords (arrays exported through fw.export)."""
        return dict(use_gate_in_kernel=self.use_gate, A_log=fw.export(self.A_log),
                    dt_bias=fw.export(self.dt_bias), use_beta_sigmoid_in_kernel=self.use_sig)

    def workspace_options(self):
        """The gate flags as _C.workspace_bytes takes them (a fused gate needs
        a workspace region of its own)."""
        if not (self.use_gate or self.use_sig):
            return {}
        return dict(use_gate_in_kernel=self.use_gate, use_beta_sigmoid_in_kernel=self.use_sig)


NO_GATES = FusedGates(False, None, None, False)


def prepare_gate_params(fw, q, use_gate_in_kernel, A_log, dt_bias):
    """A_log, dt_bias [HV] in the parameter dtype (float32; float64 with
    float64 inputs), or (None, None) without use_gate_in_kernel (FLA ignores
    them then too)."""
    if not use_gate_in_kernel:
        return None, None
    if A_log is None:
        raise ValueError("A_log: required with use_gate_in_kernel=True "
                         "(g = -exp(A_log) * softplus(a + dt_bias))")
    check_ndim(A_log, "A_log", 1, "[HV]")
    check_ndim(dt_bias, "dt_bias", 1, "[HV]")
    return prepare_state(fw, A_log, q), prepare_state(fw, dt_bias, q)


def sizes_of(q, v, cu):
    B, T, H, K = (int(s) for s in q.shape)
    HV, V = int(v.shape[2]), int(v.shape[3])
    N = B if cu is None else max(int(cu.shape[0]) - 1, 0)
    return B, T, H, HV, K, V, N


def resolve_scale(scale, q):
    return scale_of(scale, q)


# --------------------------------------------------------------- raw calls ----
# Inputs already prepared (contiguous, dtypes settled); outputs allocated here.
# Arrays reach _C through fw.export (a capsule for torch: requires_grad does
# not matter there, these calls are below any autograd).

def _exported(fw, launch):
    """The launch keywords (stream=, workspace=) with the workspace exported."""
    if launch.get("workspace") is not None:
        launch = dict(launch, workspace=fw.export(launch["workspace"]))
    return launch


def detached(fw, *xs):
    return tuple(None if x is None else fw.detach(x) for x in xs)


def chunk_fwd_prepared(fw, q, k, v, g, beta, h0, cu, scale, output_final_state,
                       use_qk_l2norm, gates=NO_GATES, state_layout="kv", pool=None, idx=None,
                       checkpoint_every=0):
    """(o, final_state); with checkpoint_every (o, final_state, (checkpoints,
    cu_checkpoints)). pool [P, HV, K, V] (with idx [N] or None): pool-indexed
    prefill, h0 None and no final state."""
    B, T, H, HV, K, V, N = sizes = sizes_of(q, v, cu)
    dt = fw.dtype_name(q)
    sd = state_dtype_of(dt)
    o = fw.empty_like(v)                                       # [B, T, HV, V]
    ht = fw.empty((N, HV) + state_dims(K, V, state_layout), sd, q) if output_final_state else None
    ck = cuck = None
    if checkpoint_every:
        ck = fw.empty((B * (T // checkpoint_every), HV) + state_dims(K, V, state_layout), sd, q)
        cuck = fw.empty((N + 1,), "int64", q)
    launch = fw.launch("fwd", q, sizes, dt, **gates.workspace_options())
    fw.before_call((q, k, v, g, beta, h0, cu, pool, idx, gates.A_log, gates.dt_bias))
    x = fw.export
    _C.chunk_fwd(x(q), x(k), x(v), x(g), x(beta), x(o), scale=scale, initial_state=x(h0),
                 final_state=x(ht), cu_seqlens=x(cu), use_qk_l2norm=bool(use_qk_l2norm),
                 state=x(pool), state_indices=x(idx), checkpoint_every=int(checkpoint_every or 0),
                 checkpoints=x(ck), cu_checkpoints=x(cuck), state_layout=state_layout,
                 **gates.kwargs(fw), **_exported(fw, launch))
    fw.after_call(q)
    if checkpoint_every:
        return fw.output(o), fw.output(ht), (fw.output(ck), fw.output(cuck))
    return fw.output(o), fw.output(ht)


def chunk_bwd_prepared(fw, q, k, v, g, beta, h0, cu, scale, use_qk_l2norm, do, dht,
                       gates=NO_GATES, state_layout="kv"):
    """(dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias): dh0 None without h0,
    dA_log / ddt_bias None without use_gate_in_kernel / dt_bias. With fused
    gates dg and dbeta are the gradients of the raw a and b."""
    B, T, H, HV, K, V, N = sizes = sizes_of(q, v, cu)
    dt = fw.dtype_name(q)
    do = fw.contiguous(do)
    if fw.dtype_name(do) != dt and fw.is_floating(do):
        do = fw.astype(do, dt)
    dht = prepare_state(fw, dht, q)
    dq, dk, dv, dg, dbeta = (fw.empty_like(x) for x in (q, k, v, g, beta))
    dh0 = None if h0 is None else fw.empty_like(h0)
    dA = None if not gates.use_gate else fw.empty_like(gates.A_log)
    ddt = None if not gates.use_gate or gates.dt_bias is None else fw.empty_like(gates.dt_bias)
    launch = fw.launch("bwd", q, sizes, dt, **gates.workspace_options())
    fw.before_call((q, k, v, g, beta, h0, cu, do, dht, gates.A_log, gates.dt_bias))
    x = fw.export
    _C.chunk_bwd(x(q), x(k), x(v), x(g), x(beta), x(do), x(dq), x(dk), x(dv), x(dg), x(dbeta),
                 scale=scale, initial_state=x(h0), dfinal_state=x(dht), dinitial_state=x(dh0),
                 cu_seqlens=x(cu), use_qk_l2norm=bool(use_qk_l2norm), state_layout=state_layout,
                 dA_log=x(dA), ddt_bias=x(ddt), **gates.kwargs(fw), **_exported(fw, launch))
    fw.after_call(q)
    return tuple(fw.output(y) for y in (dq, dk, dv, dg, dbeta, dh0, dA, ddt))


# ---------------------------------------------------------- public: chunk ----

class ChunkContext:
    """What gdn_chunk_bwd needs from gdn_chunk_fwd: the (prepared) inputs and
    options. Nothing computed in the forward is kept: the backward recomputes
    it from the inputs."""

    __slots__ = ("framework", "inputs", "scale", "use_qk_l2norm", "grad_dtypes", "gates",
                 "state_layout")

    def __init__(self, framework, inputs, scale, use_qk_l2norm, grad_dtypes, gates=NO_GATES,
                 state_layout="kv"):
        self.framework = framework
        self.inputs = inputs              # q, k, v, g, beta, h0, cu_seqlens
        self.scale = scale
        self.use_qk_l2norm = use_qk_l2norm
        self.grad_dtypes = grad_dtypes    # caller's dtypes of g, beta, initial_state (, A_log, dt_bias)
        self.gates = gates                # FusedGates (prepared A_log, dt_bias)
        self.state_layout = state_layout

    def __repr__(self):
        q = self.inputs[0]
        return (f"ChunkContext({self.framework.name}, q{list(q.shape)} "
                f"{self.framework.dtype_name(q)}, scale={self.scale:g}, "
                f"use_qk_l2norm={self.use_qk_l2norm})")


def chunk_public_arrays(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias):
    """The chunk functions' arrays as the binding takes them (capsules and
    __dlpack__ objects imported) and their framework: ((q, k, v, g, beta,
    initial_state, cu_seqlens, A_log, dt_bias), fw)."""
    arrays = public_arrays(
        [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state),
         ("cu_seqlens", cu_seqlens), ("A_log", A_log), ("dt_bias", dt_bias)],
        required=("q", "k", "v", "g", "beta"))
    q, _, _, g, beta, initial_state, _, A_log, dt_bias = arrays
    fw = common_framework([("q", q), ("g", g), ("beta", beta), ("initial_state", initial_state),
                           ("A_log", A_log), ("dt_bias", dt_bias)])
    return arrays, fw


def gdn_chunk_fwd(q, k, v, g, beta, *, scale=None, initial_state=None,
                  output_final_state=False, cu_seqlens=None, use_qk_l2norm=False,
                  state_layout="kv", use_gate_in_kernel=False, A_log=None, dt_bias=None,
                  use_beta_sigmoid_in_kernel=False):
    """Chunked forward of the gated delta rule without autograd.

    Returns (o, final_state, ctx): final_state [N, HV, K, V] ([N, HV, V, K]
    with state_layout="vk") is None unless output_final_state; ctx goes to
    gdn_chunk_bwd. Fused gates as in gdn_chunk. NumPy, PyTorch and CuPy arrays
    (JAX arrays take flashqla.jax.gdn_chunk_fwd, an XLA custom call)."""
    check_layout(state_layout)
    grad_dtypes = None
    (q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias), fw = chunk_public_arrays(
        q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias)
    if fw is not None:
        grad_dtypes = tuple(None if x is None else fw.dtype_name(x)
                            for x in (g, beta, initial_state, A_log, dt_bias))
    if fw is TORCH:
        q, k, v, g, beta, initial_state, A_log, dt_bias = detached(
            fw, q, k, v, g, beta, initial_state, A_log, dt_bias)
    fw, q, k, v, g, beta, h0, cu = prepare_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    A_log, dt_bias = prepare_gate_params(fw, q, use_gate_in_kernel, A_log, dt_bias)
    gates = FusedGates(use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel)
    scale = resolve_scale(scale, q)
    o, ht = chunk_fwd_prepared(fw, q, k, v, g, beta, h0, cu, scale, output_final_state,
                               use_qk_l2norm, gates, state_layout)
    ctx = ChunkContext(fw, (q, k, v, g, beta, h0, cu), scale, bool(use_qk_l2norm), grad_dtypes,
                       gates, state_layout)
    return o, ht, ctx


def gdn_chunk_bwd(ctx, do, dfinal_state=None):
    """Backward of gdn_chunk_fwd: from do [B, T, HV, V] (and dfinal_state,
    None meaning zero) returns (dq, dk, dv, dg, dbeta, dinitial_state), each
    in the dtype of its input; dinitial_state is None when no initial state
    was given. With use_gate_in_kernel, (..., dinitial_state, dA_log,
    ddt_bias) (ddt_bias None without dt_bias), and dg, dbeta are the
    gradients of the raw a, b that were passed as g, beta."""
    if not isinstance(ctx, ChunkContext):
        raise TypeError(f"ctx: expected the ChunkContext returned by gdn_chunk_fwd, "
                        f"got {type(ctx).__name__}")
    fw = ctx.framework
    if do is None:
        raise TypeError("do: the gradient of o is required (zeros if o is unused)")
    do, dfinal_state = public_arrays([("do", do), ("dfinal_state", dfinal_state)], required=("do",))
    dfw = common_framework([("do", do), ("dfinal_state", dfinal_state)])
    if dfw is fw:
        check_float_dtypes(fw, [("do", do), ("dfinal_state", dfinal_state)])
    if dfw is not fw:
        raise TypeError(f"do: is a {dfw.name} array but the forward ran on {fw.name} arrays")
    q, k, v, g, beta, h0, cu = ctx.inputs
    grads = chunk_bwd_prepared(fw, q, k, v, g, beta, h0, cu, ctx.scale, ctx.use_qk_l2norm,
                               do, dfinal_state, ctx.gates, ctx.state_layout)
    dq, dk, dv = grads[:3]
    back = []
    for grad, want in zip(grads[3:], tuple(ctx.grad_dtypes or ()) + (None,) * 5):
        if grad is not None and want is not None and fw.dtype_name(grad) != want:
            grad = fw.astype(grad, want)
        back.append(grad)
    return (dq, dk, dv) + tuple(back[:5 if ctx.gates.use_gate else 3])


def recurrent_prepared(fw, q, k, v, g, beta, state, idx, cu, scale, use_qk_l2norm,
                       gates=NO_GATES, state_layout="kv", intermediate_states=None,
                       update_state=True):
    B, T, H, HV, K, V, N = sizes = sizes_of(q, v, cu)
    dt = fw.dtype_name(q)
    o = fw.empty_like(v)                                       # [B, T, HV, V]
    # the step's CUDA scratch is the cu_seqlens validity flag: none without cu_seqlens (gdn.h)
    launch = fw.launch("recurrent", q, sizes if cu is not None else None, dt)
    fw.before_call((q, k, v, g, beta, state, idx, cu, intermediate_states, gates.A_log,
                    gates.dt_bias))
    x = fw.export
    serving = {}  # only what differs from the defaults: the decode step is host-latency bound
    if intermediate_states is not None or not update_state or state_layout != "kv":
        serving = dict(intermediate_states=x(intermediate_states), update_state=bool(update_state),
                       state_layout=state_layout)
    if gates.use_gate or gates.use_sig:
        serving.update(gates.kwargs(fw))
    _C.recurrent(x(q), x(k), x(v), x(g), x(beta), x(state), x(o), scale=scale,
                 state_indices=x(idx), cu_seqlens=x(cu), use_qk_l2norm=bool(use_qk_l2norm),
                 **serving, **_exported(fw, launch))
    fw.after_call(q)
    return fw.output(o)


def commit_prepared(fw, state, intermediate_states, idx, num_accepted, state_layout="kv"):
    launch = fw.launch("commit", state, None, None)
    fw.before_call((state, intermediate_states, idx, num_accepted))
    x = fw.export
    _C.commit(x(state), x(intermediate_states), x(num_accepted), state_indices=x(idx),
              state_layout=state_layout, **{k: v for k, v in launch.items() if k == "stream"})
    fw.after_call(state)
