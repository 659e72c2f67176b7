"""flashqla.jax — the JAX front-end: flashqla's kernels as XLA custom calls.

    import flashqla.jax as fqj
    o, ht = fqj.gdn_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    grads = jax.grad(lambda q: fqj.gdn_chunk(q, k, v, g, beta)[0].sum())(q)
    o, pool = fqj.gdn_recurrent(q, k, v, g, beta, pool, state_indices=slots)

Each kernel is an XLA FFI custom call (jax.ffi.ffi_call) whose handler is C
code in the extension (csrc/xla/gdn_xla.c), registered with
jax.ffi.register_ffi_target on first use, for the CPU and (with the CUDA
build) the CUDA platform. So the calls work under jax.jit, jax.grad
(gdn_chunk is a jax.custom_vjp whose backward is the C backward),
jax.vmap, jax.checkpoint and lax.scan. On the GPU a handler launches on the
stream XLA gives it and takes its scratch from XLA's allocator; nothing
waits on the host.

gdn_recurrent returns (o, new_state); new_state is aliased to the state
argument (input_output_aliases), so in a jitted step whose pool argument is
donated (jax.jit(step, donate_argnums=...)) XLA updates the pool in place,
without a copy. Not donated, XLA copies the pool once so that the caller's
array stays as it was.

Shapes as flashqla.gdn_chunk / flashqla.gdn_recurrent (time-major, FLA's):
q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV]; initial_state and
final_state [N, HV, K, V]; state [P, HV, K, V]; cu_seqlens [N + 1] (B == 1);
state_indices [N]. Shapes and dtypes are checked when the call is traced
(ValueError / TypeError naming the argument); what only the values can tell
(cu_seqlens contents on the CPU, a head dim the backend lacks) raises from
the computation, with flashqla's message.
"""

from __future__ import annotations

from typing import Optional, Tuple


import functools

import numpy as np

try:
    import jax
    import jax.numpy as jnp
except ImportError as _err:  # pragma: no cover - the test extras install jax
    raise ImportError(f"flashqla.jax needs JAX ({_err}); install it with `pip install jax`") \
        from _err

from . import _C
from ._frameworks import JAX, _numpy_index, scale_of
from ._prepared import ChunkContext
from ._typing import Array, Indices

__all__ = ["gdn_chunk", "gdn_recurrent", "gdn_chunk_fwd", "gdn_chunk_bwd"]

_FLOATS = ("float32", "float16", "bfloat16", "float64")


# ------------------------------------------------------------ registration --

@functools.lru_cache(maxsize=None)
def _registered():
    """Registers the extension's XLA FFI handlers with JAX, once; returns the
    platforms that have them."""
    targets = _C.xla_ffi_targets()
    if not targets:
        raise _C.Error(
            "flashqla.jax: this build of flashqla has no XLA FFI handlers (it was built with "
            "FLASHQLA_NO_XLA_FFI=1, or without the header xla/ffi/api/c_api.h: neither jaxlib "
            "nor csrc/third_party/xla was there at build time); reinstall flashqla from a "
            "complete source tree")
    platforms = set()
    for name, platform, capsule in targets:
        jax.ffi.register_ffi_target(name, capsule, platform=platform)
        platforms.add(platform)
    return frozenset(platforms)


# ------------------------------------------------------------- preparation --

def _dtype(x):
    return jnp.dtype(x.dtype).name


def _array(x, name, required=True):
    if x is None:
        if required:
            raise TypeError(f"{name}: expected a JAX array, got None")
        return None
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name}: expected a JAX array, got {type(x).__module__}."
                        f"{type(x).__name__}")
    return jnp.asarray(x)


def _index(x, name):
    """cu_seqlens / state_indices as an int32 or int64 JAX array."""
    if x is None:
        return None
    if not hasattr(x, "dtype"):
        x = _numpy_index(x, name)  # integers only (no bool, str, fraction)
        big = x.size and (int(x.max()) >= 2 ** 31 or int(x.min()) < -2 ** 31)
        x = x.astype(np.int64 if big else np.int32)
    x = jnp.asarray(x)
    if _dtype(x) not in ("int32", "int64"):
        raise TypeError(f"{name}: expected dtype int32 or int64, got {_dtype(x)}")
    if x.ndim != 1:
        raise ValueError(f"{name}: expected a 1-d array, got shape {list(x.shape)}")
    return x


def _state_dtype(q):
    return "float64" if _dtype(q) == "float64" else "float32"


def _shape_error(name, want, got):
    return ValueError(f"{name}: expected shape {want}, got {list(got)}")


def _prepare(q, k, v, g, beta, cu_seqlens):
    """Shapes and dtypes checked at trace time; g and beta cast like the C
    binding takes them (both float32 or both q's dtype, else float32: the
    cast is outside the custom call, so gradients are cast back)."""
    q, k, v, g, beta = (_array(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"), (g, "g"),
                                                  (beta, "beta")))
    if q.ndim != 4:
        raise ValueError(f"q: expected 4 dimensions [B, T, H, K], got shape {list(q.shape)}")
    B, T, H, K = q.shape
    if K < 1:
        raise ValueError(f"q: expected head dim K >= 1 in [B, T, H, K], got shape {list(q.shape)}")
    if _dtype(q) not in _FLOATS:
        raise TypeError(f"q: expected dtype float32, float16, bfloat16 or float64, got {_dtype(q)}")
    if k.shape != q.shape:
        raise _shape_error("k", f"{list(q.shape)} like q", k.shape)
    if v.ndim != 4 or v.shape[:2] != (B, T):
        raise _shape_error("v", f"[B={B}, T={T}, HV, V]", v.shape)
    HV = v.shape[2]
    if HV % H:
        raise ValueError(f"v: the value heads HV={HV} must be a multiple of the q/k heads H={H}")
    for x, n in ((k, "k"), (v, "v")):
        if _dtype(x) != _dtype(q):
            raise TypeError(f"{n}: expected dtype {_dtype(q)} like q, got {_dtype(x)}")
    for x, n in ((g, "g"), (beta, "beta")):
        if x.shape != (B, T, HV):
            raise _shape_error(n, f"[{B}, {T}, {HV}] ([B, T, HV])", x.shape)
        if _dtype(x) not in _FLOATS:
            raise TypeError(f"{n}: expected a float dtype, got {_dtype(x)}")
    if not (_dtype(g) == _dtype(beta) and _dtype(g) in ("float32", _dtype(q))):
        g, beta = g.astype(jnp.float32), beta.astype(jnp.float32)
    cu = _index(cu_seqlens, "cu_seqlens")
    if cu is not None:
        if cu.shape[0] < 2:
            raise ValueError(f"cu_seqlens: expected N+1 >= 2 offsets, got shape {list(cu.shape)}")
        if B != 1:
            raise ValueError(f"cu_seqlens: packed sequences need q of batch size 1, got {B}")
    N = B if cu is None else cu.shape[0] - 1
    return q, k, v, g, beta, cu, N


def _prepare_state(x, name, q, shape):
    x = _array(x, name, required=False)
    if x is None:
        return None
    if tuple(x.shape) != tuple(shape):
        raise _shape_error(name, list(shape), x.shape)
    if _dtype(x) not in _FLOATS:
        raise TypeError(f"{name}: expected a float dtype, got {_dtype(x)}")
    return x.astype(_state_dtype(q))


def _scale(scale, q):
    return scale_of(scale, q)


def _flag(x):
    return np.int32(1 if x else 0)


# ------------------------------------------------------------ custom calls --

def _chunk_fwd_call(q, k, v, g, beta, h0, cu, scale, output_final_state, use_qk_l2norm):
    _registered()
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu is None else cu.shape[0] - 1
    outs = [jax.ShapeDtypeStruct(v.shape, q.dtype)]
    if output_final_state:
        outs.append(jax.ShapeDtypeStruct((N, HV, K, V), _state_dtype(q)))
    args = [q, k, v, g, beta] + [x for x in (h0, cu) if x is not None]
    call = jax.ffi.ffi_call("flashqla_chunk_fwd", outs,
                            vmap_method="broadcast_all" if cu is None else "sequential")
    res = call(*args, scale=np.float64(scale), use_qk_l2norm=_flag(use_qk_l2norm),
               has_initial_state=_flag(h0 is not None), has_cu_seqlens=_flag(cu is not None),
               output_final_state=_flag(output_final_state))
    return res[0], (res[1] if output_final_state else None)


def _chunk_bwd_call(q, k, v, g, beta, h0, cu, do, dht, scale, use_qk_l2norm):
    _registered()
    outs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v, g, beta)]
    if h0 is not None:
        outs.append(jax.ShapeDtypeStruct(h0.shape, h0.dtype))
    do = do.astype(q.dtype)
    if dht is not None:
        dht = dht.astype(_state_dtype(q))
    args = [q, k, v, g, beta] + [x for x in (h0, cu) if x is not None] + [do] + \
        ([dht] if dht is not None else [])
    call = jax.ffi.ffi_call("flashqla_chunk_bwd", outs,
                            vmap_method="broadcast_all" if cu is None else "sequential")
    res = call(*args, scale=np.float64(scale), use_qk_l2norm=_flag(use_qk_l2norm),
               has_initial_state=_flag(h0 is not None), has_cu_seqlens=_flag(cu is not None),
               has_dfinal_state=_flag(dht is not None))
    return tuple(res[:5]) + ((res[5] if h0 is not None else None),)


# opts: (scale, output_final_state, use_qk_l2norm), static
@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _chunk(q, k, v, g, beta, h0, cu, opts):
    scale, output_final_state, use_qk_l2norm = opts
    return _chunk_fwd_call(q, k, v, g, beta, h0, cu, scale, output_final_state, use_qk_l2norm)


def _chunk_vjp_fwd(q, k, v, g, beta, h0, cu, opts):
    scale, output_final_state, use_qk_l2norm = opts
    out = _chunk_fwd_call(q, k, v, g, beta, h0, cu, scale, output_final_state, use_qk_l2norm)
    return out, (q, k, v, g, beta, h0, cu)  # the backward recomputes from the inputs


def _chunk_vjp_bwd(opts, residuals, cotangents):
    scale, output_final_state, use_qk_l2norm = opts
    q, k, v, g, beta, h0, cu = residuals
    do, dht = cotangents
    grads = _chunk_bwd_call(q, k, v, g, beta, h0, cu, do, dht if output_final_state else None,
                            scale, use_qk_l2norm)
    return grads + (None,)  # no gradient for cu_seqlens


_chunk.defvjp(_chunk_vjp_fwd, _chunk_vjp_bwd)


# ------------------------------------------------------------------ public --

def _serving_gates(g, beta, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel):
    """The fused-gate options of flashqla.gdn_chunk (issue 11) for JAX: the
    gates computed with jax.numpy before the custom call (so jax.grad and
    jax.jit see through them; the CUDA/CPU kernels fuse them only for the
    other frameworks): g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b),
    in float32 (float64 with float64 gates)."""
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("A_log: required with use_gate_in_kernel=True "
                             "(g = -exp(A_log) * softplus(a + dt_bias))")
        a = jnp.asarray(g)
        a = a.astype(jnp.float64 if a.dtype == jnp.float64 else jnp.float32)
        x = a if dt_bias is None else a + jnp.asarray(dt_bias).astype(a.dtype)
        g = -jnp.exp(jnp.asarray(A_log).astype(a.dtype)) * jnp.where(
            x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))
    if use_beta_sigmoid_in_kernel:
        b = jnp.asarray(beta)
        beta = jax.nn.sigmoid(b.astype(jnp.float64 if b.dtype == jnp.float64 else jnp.float32))
    if (use_gate_in_kernel or use_beta_sigmoid_in_kernel) and g.dtype != beta.dtype:
        g, beta = jnp.asarray(g).astype(jnp.float32), jnp.asarray(beta).astype(jnp.float32)
    return g, beta


def _layout(state_layout):
    if state_layout not in ("kv", "vk"):
        raise ValueError(f"state_layout: expected \"kv\" (states [.., K, V]) or \"vk\" "
                         f"([.., V, K]), got {state_layout!r}")
    return state_layout == "vk"


def _swap(x):
    """[.., K, V] <-> [.., V, K] (a transpose around the custom call for
    state_layout="vk" on JAX)."""
    return None if x is None else jnp.swapaxes(jnp.asarray(x), -1, -2)


def gdn_chunk(q: Array, k: Array, v: Array, g: Array, beta: Array, *,
              scale: Optional[float] = None, initial_state: Optional[Array] = None,
              output_final_state: bool = False, cu_seqlens: Optional[Indices] = None,
              use_qk_l2norm: bool = False, state_layout: str = "kv",
              use_gate_in_kernel: bool = False, A_log: Optional[Array] = None,
              dt_bias: Optional[Array] = None,
              use_beta_sigmoid_in_kernel: bool = False) -> Tuple[Array, Optional[Array]]:
    """flashqla.gdn_chunk for JAX: the chunked forward as an XLA custom call,
    differentiable (jax.custom_vjp; the backward is the C backward).

    q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV]; initial_state
    [N, HV, K, V]; cu_seqlens [N + 1] (B == 1). Returns (o [B, T, HV, V] in
    q's dtype, final_state [N, HV, K, V] float32 (float64 with float64 inputs)
    or None unless output_final_state). state_layout="vk": initial and final
    state [N, HV, V, K] (a transpose around the call). Fused gates as in
    flashqla.gdn_chunk, computed with jax.numpy before the call (gradients to
    a, b, A_log, dt_bias by JAX's autodiff). No pool or checkpoints (JAX
    arrays are not written in place)."""
    vk = _layout(state_layout)
    g, beta = _serving_gates(g, beta, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel)
    if vk:
        initial_state = _swap(initial_state)
        o, ht = gdn_chunk(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                          output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                          use_qk_l2norm=use_qk_l2norm)
        return o, _swap(ht)
    q, k, v, g, beta, cu, N = _prepare(q, k, v, g, beta, cu_seqlens)
    h0 = _prepare_state(initial_state, "initial_state", q, (N, v.shape[2], q.shape[3], v.shape[3]))
    opts = (_scale(scale, q), bool(output_final_state), bool(use_qk_l2norm))
    return _chunk(q, k, v, g, beta, h0, cu, opts)


def gdn_recurrent(q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array, *,
                  state_indices: Optional[Indices] = None, scale: Optional[float] = None,
                  cu_seqlens: Optional[Indices] = None, use_qk_l2norm: bool = False,
                  state_layout: str = "kv", use_gate_in_kernel: bool = False,
                  A_log: Optional[Array] = None, dt_bias: Optional[Array] = None,
                  use_beta_sigmoid_in_kernel: bool = False) -> Tuple[Array, Array]:
    """flashqla.gdn_recurrent for JAX, which has no in-place update: returns
    (o [B, T, HV, V], new_state [P, HV, K, V]). q, k [B, T, H, K];
    v [B, T, HV, V]; g, beta [B, T, HV]; state [P, HV, K, V]; state_indices
    [N]; cu_seqlens [N + 1] (B == 1).

    new_state is aliased to `state` (donate the pool under jax.jit and it is
    updated in place). Sequence n starts from slot state_indices[n] (slot n
    without indices) and leaves its final state there; a negative slot is
    padding (o rows 0, pool untouched). No gradients. state_layout="vk": the
    pool [P, HV, V, K] (transposed around the call, so no aliasing then);
    fused gates computed with jax.numpy before the call. (Speculative verify
    with intermediate states: flashqla.gdn_recurrent with PyTorch, NumPy or
    CuPy arrays.)"""
    vk = _layout(state_layout)
    g, beta = _serving_gates(g, beta, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel)
    if vk:
        o, new_state = gdn_recurrent(q, k, v, g, beta, _swap(state), state_indices=state_indices,
                                     scale=scale, cu_seqlens=cu_seqlens,
                                     use_qk_l2norm=use_qk_l2norm)
        return o, _swap(new_state)
    q, k, v, g, beta, cu, N = _prepare(q, k, v, g, beta, cu_seqlens)
    state = _array(state, "state")
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    if state is None or state.ndim != 4 or tuple(state.shape[1:]) != (HV, K, V):
        raise _shape_error("state", f"[P, {HV}, {K}, {V}] ([P, HV, K, V])",
                           () if state is None else state.shape)
    if _dtype(state) != _state_dtype(q):
        raise TypeError(f"state: expected dtype {_state_dtype(q)} (the pool is updated in place "
                        f"and keeps its dtype), got {_dtype(state)}")
    idx = _index(state_indices, "state_indices")
    if idx is not None and idx.shape[0] != N:
        raise _shape_error("state_indices", f"[{N}] ([N], one slot per sequence)", idx.shape)
    if idx is None and state.shape[0] != N:
        raise ValueError(f"state: without state_indices the pool must have N={N} slots, "
                         f"got shape {list(state.shape)}")
    _registered()
    call = jax.ffi.ffi_call("flashqla_recurrent",
                            (jax.ShapeDtypeStruct(v.shape, q.dtype),
                             jax.ShapeDtypeStruct(state.shape, state.dtype)),
                            vmap_method="sequential", input_output_aliases={5: 1})
    args = [q, k, v, g, beta, state] + [x for x in (idx, cu) if x is not None]
    o, new_state = call(*args, scale=np.float64(_scale(scale, q)),
                        use_qk_l2norm=_flag(use_qk_l2norm), has_state_indices=_flag(idx is not None),
                        has_cu_seqlens=_flag(cu is not None))
    return o, new_state


def gdn_chunk_fwd(q: Array, k: Array, v: Array, g: Array, beta: Array, *,
                  scale: Optional[float] = None, initial_state: Optional[Array] = None,
                  output_final_state: bool = False, cu_seqlens: Optional[Indices] = None,
                  use_qk_l2norm: bool = False) -> Tuple[Array, Optional[Array], ChunkContext]:
    """flashqla.gdn_chunk_fwd for JAX arrays: (o, final_state, ctx), no autodiff.
    q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV]; initial_state
    [N, HV, K, V]; cu_seqlens [N + 1]."""
    grad_dtypes = tuple(None if x is None else _dtype(jnp.asarray(x))
                        for x in (g, beta, initial_state))
    q, k, v, g, beta, cu, N = _prepare(q, k, v, g, beta, cu_seqlens)
    h0 = _prepare_state(initial_state, "initial_state", q, (N, v.shape[2], q.shape[3], v.shape[3]))
    scale = _scale(scale, q)
    o, ht = _chunk_fwd_call(q, k, v, g, beta, h0, cu, scale, bool(output_final_state),
                            bool(use_qk_l2norm))
    ctx = ChunkContext(JAX, (q, k, v, g, beta, h0, cu), scale, bool(use_qk_l2norm), grad_dtypes)
    return o, ht, ctx


def gdn_chunk_bwd(ctx: ChunkContext, do: Array,
                  dfinal_state: Optional[Array] = None) -> Tuple[Array, Array, Array, Array, Array, Optional[Array]]:
    """flashqla.gdn_chunk_bwd for a context of gdn_chunk_fwd on JAX arrays:
    do [B, T, HV, V], dfinal_state [N, HV, K, V] (or None); returns dq, dk
    [B, T, H, K], dv [B, T, HV, V], dg, dbeta [B, T, HV], dinitial_state."""
    q, k, v, g, beta, h0, cu = ctx.inputs
    do = _array(do, "do")
    if tuple(do.shape) != tuple(v.shape):
        raise _shape_error("do", list(v.shape), do.shape)
    dht = _prepare_state(dfinal_state, "dfinal_state", q,
                         (h0.shape[0] if h0 is not None else (q.shape[0] if cu is None
                                                               else cu.shape[0] - 1),
                          v.shape[2], q.shape[3], v.shape[3]))
    grads = _chunk_bwd_call(q, k, v, g, beta, h0, cu, do, dht, ctx.scale, ctx.use_qk_l2norm)
    back = list(grads)
    for i, want in zip((3, 4, 5), ctx.grad_dtypes):
        if back[i] is not None and want is not None and _dtype(back[i]) != want:
            back[i] = back[i].astype(want)
    return tuple(back)
