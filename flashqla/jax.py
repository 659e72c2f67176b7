"""flashqla.jax — the JAX front end.

    import flashqla.jax as fqj
    o, ht = fqj.gdn_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    grads = jax.grad(lambda q: fqj.gdn_chunk(q, k, v, g, beta)[0].sum())(q)
    o, new_state = fqj.gdn_recurrent(q, k, v, g, beta, state)

gdn_chunk is a jax.custom_vjp function, so jax.grad / jax.vjp work; its
backward is flashqla's C backward. Arrays must be concrete (eager mode): the
kernels run outside XLA, so calls inside jax.jit / jax.vmap raise TypeError.
On GPU the kernels run on the device's legacy default stream after the inputs
are ready, and are waited for before the outputs are handed to JAX.
"""

import functools

import jax
import jax.numpy as jnp

from . import _prepared
from ._frameworks import JAX, _numpy_index, common_framework

__all__ = ["gdn_chunk", "gdn_recurrent"]


def _dtype_name(x):
    return None if x is None else jnp.dtype(x.dtype).name


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _chunk(q, k, v, g, beta, h0, cu_seqlens, opts):
    scale, output_final_state, use_qk_l2norm, _ = opts
    o, ht, _ = _prepared.gdn_chunk_fwd(q, k, v, g, beta, scale=scale, initial_state=h0,
                                  output_final_state=output_final_state,
                                  cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm)
    return o, ht


def _chunk_fwd(q, k, v, g, beta, h0, cu_seqlens, opts):
    scale, output_final_state, use_qk_l2norm, _ = opts
    o, ht, ctx = _prepared.gdn_chunk_fwd(q, k, v, g, beta, scale=scale, initial_state=h0,
                                    output_final_state=output_final_state,
                                    cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm)
    return (o, ht), ctx.inputs  # residuals: the prepared inputs (arrays / None)


def _chunk_bwd(opts, residuals, cotangents):
    scale, output_final_state, use_qk_l2norm, grad_dtypes = opts
    do, dht = cotangents
    ctx = _prepared.ChunkContext(JAX, residuals, scale, use_qk_l2norm, grad_dtypes)
    dq, dk, dv, dg, dbeta, dh0 = _prepared.gdn_chunk_bwd(
        ctx, do, dht if output_final_state else None)
    return dq, dk, dv, dg, dbeta, dh0, None


_chunk.defvjp(_chunk_fwd, _chunk_bwd)


def gdn_chunk(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, use_qk_l2norm=False):
    """flashqla.gdn_chunk for JAX arrays, differentiable with jax.grad.
    Returns (o, final_state or None); see flashqla.gdn_chunk for shapes."""
    # Under jax.grad the arguments here are tracers; _chunk's forward receives
    # the concrete values (and rejects tracers of jax.jit / jax.vmap).
    common_framework([("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta),
                      ("initial_state", initial_state)], check=False)
    if getattr(q, "ndim", None) != 4:
        raise ValueError(f"q: expected 4 dimensions [B, T, H, K], got shape "
                         f"{list(getattr(q, 'shape', ()))}")
    scale = float(q.shape[-1]) ** -0.5 if scale is None else float(scale)
    grad_dtypes = (_dtype_name(g), _dtype_name(beta), _dtype_name(initial_state))
    if cu_seqlens is not None and not isinstance(cu_seqlens, jax.Array):
        cu_seqlens = jnp.asarray(_numpy_index(cu_seqlens))
    opts = (scale, bool(output_final_state), bool(use_qk_l2norm), grad_dtypes)
    return _chunk(q, k, v, g, beta, initial_state, cu_seqlens, opts)


def gdn_recurrent(q, k, v, g, beta, state, *, state_indices=None, scale=None,
                  cu_seqlens=None, use_qk_l2norm=False):
    """flashqla.gdn_recurrent for JAX arrays, which are immutable: returns
    (o, new_state) and leaves `state` as it was. new_state is a fresh copy of
    the pool (float32; float64 with float64 inputs) that the step updated."""
    fw = common_framework([("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta),
                           ("state", state)])
    if fw is not JAX:
        raise TypeError(f"q: flashqla.jax.gdn_recurrent takes JAX arrays, got {fw.name} "
                        f"arrays (use flashqla.gdn_recurrent)")
    if getattr(state, "ndim", None) != 4:
        raise ValueError(f"state: expected 4 dimensions [P, HV, K, V], got shape "
                         f"{list(getattr(state, 'shape', ()))}")
    fw, q, k, v, g, beta, _, cu = _prepared.prepare_inputs(q, k, v, g, beta, None, cu_seqlens)
    idx = None
    if state_indices is not None:
        idx = fw.index_array(state_indices, q, "state_indices")
    # A fresh buffer that nothing else refers to, updated in place by the step
    # and then handed out as the new state.
    new_state = jnp.array(_prepared.prepare_state(fw, state, q), copy=True)
    o = _prepared.recurrent_prepared(fw, q, k, v, g, beta, new_state, idx, cu,
                                     _prepared.resolve_scale(scale, q), use_qk_l2norm)
    return o, new_state
