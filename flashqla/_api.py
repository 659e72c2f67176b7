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

Layers: this module picks the framework front-end (_torch.py for autograd,
jax.py for JAX) and both call down into _prepared.py, which calls _C.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Optional, Tuple

from ._frameworks import JAX, TORCH, check_float_dtypes, common_framework, public_arrays
from . import _prepared
from ._typing import Array, Indices
from ._prepared import (ChunkContext, FusedGates, check_layout, check_ndim, chunk_fwd_prepared,
                        commit_prepared, prepare_gate_params, prepare_inputs, recurrent_prepared,
                        resolve_scale)

__all__ = ["gdn_chunk", "gdn_chunk_fwd", "gdn_chunk_bwd", "gdn_recurrent", "gdn_commit",
           "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "ChunkContext"]


def _all_torch_tensors(q, k, v, g, beta, state):
    """True when every argument is a plain torch.Tensor (torch already imported)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    t = torch.Tensor
    return (type(q) is t and type(k) is t and type(v) is t and type(g) is t and
            type(beta) is t and type(state) is t)


def _jax_front():
    from . import jax
    return jax


def _torch_front():
    """flashqla._torch (imported on the first PyTorch call: it registers the
    torch.ops.flashqla operators, and importing flashqla needs no torch); from
    then on gdn_recurrent tries its decode hot path first."""
    global _torch_front, _recurrent_hot, _commit_hot, _is_compiling
    from . import _torch
    _torch_front = lambda: _torch  # noqa: E731
    _recurrent_hot, _commit_hot = _torch.recurrent_hot_entry, _torch.commit_hot
    _is_compiling = _torch.is_compiling
    return _torch


_recurrent_hot = None  # flashqla._torch.recurrent_hot_entry, once a PyTorch call brought it in
_commit_hot = None     # flashqla._torch.commit_hot, likewise
_is_compiling = None   # torch.compiler.is_compiling, likewise


def gdn_chunk(q: Array, k: Array, v: Array, g: Array, beta: Array, *,
              scale: Optional[float] = None, initial_state: Optional[Array] = None,
              output_final_state: bool = False, cu_seqlens: Optional[Indices] = None,
              use_qk_l2norm: bool = False, state: Optional[Array] = None,
              state_indices: Optional[Indices] = None, checkpoint_every: Optional[int] = None,
              state_layout: str = "kv", use_gate_in_kernel: bool = False,
              A_log: Optional[Array] = None, dt_bias: Optional[Array] = None,
              use_beta_sigmoid_in_kernel: bool = False) -> Tuple[Any, ...]:
    """Gated delta rule, chunked (prefill / training). Returns (o, final_state).

    q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV]; initial_state
    [N, HV, K, V]; cu_seqlens [N + 1] (packed sequences, B == 1; N = B without).
    o [B, T, HV, V] in q's dtype; final_state [N, HV, K, V] (float32, float64
    with float64 inputs) or None unless output_final_state. scale defaults to
    K ** -0.5. With PyTorch tensors this is torch.ops.flashqla.chunk_fwd:
    gradients flow to q, k, v, g, beta, initial_state (and A_log, dt_bias), and
    torch.compile (fullgraph=True), torch.func.grad and CUDA graphs work; with
    JAX arrays, jax.grad works (flashqla.jax.gdn_chunk, a jax.custom_vjp).

    Serving options (forward only, no gradients: with tensors that require
    grad they raise ValueError):
      state=pool [P, HV, K, V], state_indices [N]: pool-indexed prefill. Each
        sequence starts from pool[state_indices[n]] (zeros for a negative
        index) and its final state is written back there in place (nothing
        for a negative index); non-negative indices must be distinct.
        initial_state and output_final_state are not used then (final_state
        is None).
      checkpoint_every=n (a multiple of 64): returns (o, final_state,
        (checkpoints, cu_checkpoints)): sequence n's state after every n
        tokens at rows cu_checkpoints[n] .. cu_checkpoints[n+1]-1 of
        checkpoints [B * (T // n), HV, K, V]; cu_checkpoints [N + 1] int64;
        rows past cu_checkpoints[-1] (there are some only with cu_seqlens) are 0.
    state_layout="vk": every state argument and result is [.., V, K] (FLA's
    state_v_first=True; vLLM's and FlashInfer's pools).
    Fused gates (FLA 0.6.0): use_gate_in_kernel=True with A_log [HV] (and
    dt_bias [HV] or None) makes g the raw a, with g = -exp(A_log) *
    softplus(a + dt_bias) computed inside; use_beta_sigmoid_in_kernel=True
    makes beta the raw b, with sigmoid(b) inside. Gradients then flow to a,
    b, A_log and dt_bias."""
    check_layout(state_layout)
    (q, k, v, g, beta, initial_state, cu_seqlens, state, state_indices, A_log,
     dt_bias) = public_arrays(
        [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state),
         ("cu_seqlens", cu_seqlens), ("state", state), ("state_indices", state_indices),
         ("A_log", A_log), ("dt_bias", dt_bias)], required=("q", "k", "v", "g", "beta"))
    fw = common_framework([("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta),
                           ("initial_state", initial_state), ("state", state),
                           ("A_log", A_log), ("dt_bias", dt_bias)])
    serving = state is not None or checkpoint_every is not None
    if fw is JAX:  # an XLA custom call, with jax.custom_vjp
        if serving:
            raise TypeError("state, checkpoint_every: JAX arrays cannot be written in place; "
                            "pool-indexed prefill and checkpoints take PyTorch, NumPy or CuPy arrays")
        return _jax_front().gdn_chunk(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                output_final_state=output_final_state,
                                cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
                                state_layout=state_layout, use_gate_in_kernel=use_gate_in_kernel,
                                A_log=A_log, dt_bias=dt_bias,
                                use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel)
    if state is not None:
        if initial_state is not None or output_final_state:
            raise ValueError("state: a pool-indexed prefill reads and writes the pool; pass "
                             "initial_state=None and output_final_state=False")
        check_ndim(state, "state", 4, "[P, HV, K, V]" if state_layout == "kv" else "[P, HV, V, K]")
    elif state_indices is not None:
        raise ValueError("state_indices: only with state=pool (a pool-indexed prefill)")
    if checkpoint_every is not None:
        if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) \
                or checkpoint_every <= 0 or checkpoint_every % 64:
            raise ValueError(f"checkpoint_every: expected a positive multiple of 64 (the chunk "
                             f"size), got {checkpoint_every!r}")
    if fw is TORCH:  # torch.ops.flashqla.chunk_fwd (chunk_fwd_serving), with autograd
        return _torch_front().gdn_chunk(
            q, k, v, g, beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
            use_qk_l2norm=use_qk_l2norm, state=state, state_indices=state_indices,
            checkpoint_every=checkpoint_every, state_layout=state_layout,
            use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel)
    fw, q, k, v, g, beta, h0, cu = prepare_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    A_log, dt_bias = prepare_gate_params(fw, q, use_gate_in_kernel, A_log, dt_bias)
    scale = resolve_scale(scale, q)
    if serving:
        idx = None
        if state_indices is not None:
            idx = fw.index_array(state_indices, q, "state_indices")
            check_ndim(idx, "state_indices", 1, "[N]")
        gates = FusedGates(use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel)
        return chunk_fwd_prepared(fw, q, k, v, g, beta, h0, cu, scale, output_final_state,
                                  use_qk_l2norm, gates, state_layout, state, idx,
                                  checkpoint_every or 0)
    gates = FusedGates(use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel)
    return chunk_fwd_prepared(fw, q, k, v, g, beta, h0, cu, scale, output_final_state,
                              use_qk_l2norm, gates, state_layout)


def gdn_chunk_fwd(q: Array, k: Array, v: Array, g: Array, beta: Array, *,
                  scale: Optional[float] = None, initial_state: Optional[Array] = None,
                  output_final_state: bool = False, cu_seqlens: Optional[Indices] = None,
                  use_qk_l2norm: bool = False, state_layout: str = "kv",
                  use_gate_in_kernel: bool = False, A_log: Optional[Array] = None,
                  dt_bias: Optional[Array] = None, use_beta_sigmoid_in_kernel: bool = False
                  ) -> Tuple[Array, Optional[Array], ChunkContext]:
    """Chunked forward of the gated delta rule without autograd.

    q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV]; initial_state
    [N, HV, K, V]; cu_seqlens [N + 1] (packed sequences, B == 1; N = B without).
    Options as gdn_chunk (but the pool and checkpoints). Returns
    (o, final_state, ctx): final_state is None unless output_final_state; ctx
    goes to gdn_chunk_bwd. Works for every framework (JAX: flashqla.jax's
    custom calls, without the serving options: use flashqla.jax.gdn_chunk,
    which differentiates through them)."""
    arrays, fw = _prepared.chunk_public_arrays(q, k, v, g, beta, initial_state, cu_seqlens, A_log,
                                               dt_bias)
    q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias = arrays
    if fw is JAX:
        if state_layout != "kv" or use_gate_in_kernel or use_beta_sigmoid_in_kernel:
            raise ValueError("state_layout, use_gate_in_kernel, use_beta_sigmoid_in_kernel: not "
                             "taken by the JAX gdn_chunk_fwd / gdn_chunk_bwd pair; "
                             "flashqla.jax.gdn_chunk takes them (with jax.grad)")
        return _jax_front().gdn_chunk_fwd(q, k, v, g, beta, scale=scale,
                                          initial_state=initial_state,
                                          output_final_state=output_final_state,
                                          cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm)
    return _prepared.gdn_chunk_fwd(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                   output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                   use_qk_l2norm=use_qk_l2norm, state_layout=state_layout,
                                   use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
                                   dt_bias=dt_bias,
                                   use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel)


def gdn_chunk_bwd(ctx: ChunkContext, do: Array,
                  dfinal_state: Optional[Array] = None) -> Tuple[Optional[Array], ...]:
    """Backward of gdn_chunk_fwd (the forward's inputs q, k [B, T, H, K],
    v [B, T, HV, V], g, beta [B, T, HV] are in ctx): from do [B, T, HV, V] (and dfinal_state,
    None meaning zero) returns (dq, dk, dv, dg, dbeta, dinitial_state), each
    in the dtype of its input; dinitial_state is None when no initial state
    was given. With use_gate_in_kernel also dA_log, ddt_bias (ddt_bias None
    without dt_bias), and dg, dbeta are the gradients of the raw a, b."""
    if isinstance(ctx, ChunkContext) and ctx.framework is JAX:
        dfw = common_framework([("do", do), ("dfinal_state", dfinal_state)])
        if dfw is not JAX:
            raise TypeError(f"do: is a {dfw.name} array but the forward ran on jax arrays")
        return _jax_front().gdn_chunk_bwd(ctx, do, dfinal_state)
    return _prepared.gdn_chunk_bwd(ctx, do, dfinal_state)


# ------------------------------------------------------ public: recurrent ----

def gdn_recurrent(q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array, *,
                  state_indices: Optional[Indices] = None, scale: Optional[float] = None,
                  cu_seqlens: Optional[Indices] = None, use_qk_l2norm: bool = False,
                  intermediate_states: Optional[Array] = None, update_state: bool = True,
                  state_layout: str = "kv", use_gate_in_kernel: bool = False,
                  A_log: Optional[Array] = None, dt_bias: Optional[Array] = None,
                  use_beta_sigmoid_in_kernel: bool = False) -> Array:
    """Recurrent step (decode / multi-token verify) against a state pool.

    q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV]; state [P, HV, K, V];
    state_indices [N]; cu_seqlens [N + 1] (B == 1; N = B without).

    state [P, HV, K, V] (float32; float64 with float64 inputs) is read and
    updated in place: sequence n (row n of the batch, or cu_seqlens[n] ..
    cu_seqlens[n+1]-1) starts from slot state_indices[n] (slot n without
    indices) and leaves its final state there; a negative slot is padding (the
    sequence is skipped, its o rows are 0); non-negative slots must be
    distinct. Returns o [B, T, HV, V]. No gradients. PyTorch:
    torch.ops.flashqla.recurrent (torch.compile and CUDA graphs work). JAX
    arrays are immutable: use flashqla.jax.gdn_recurrent.

    Speculative verify: intermediate_states [N, Ti, HV, K, V] (state dtype;
    Ti >= T, with cu_seqlens >= every sequence's length) receives the state
    after each token t of sequence n at [n, t] (rows past a sequence's length
    and padding sequences are left as they were); update_state=False leaves
    the pool untouched; then flashqla.gdn_commit keeps the accepted prefix.
    state_layout="vk": the pool and intermediate_states are [.., V, K].
    Fused gates as in gdn_chunk."""
    hot = _recurrent_hot  # the decode hot path: PyTorch tensors straight to the binding
    tried = hot is not None and cu_seqlens is None and not use_gate_in_kernel and \
        not use_beta_sigmoid_in_kernel
    # (is_compiling here, in Python: torch.compile must see it before the hot path,
    # which may be a C function)
    if tried and not _is_compiling():
        o = hot(q, k, v, g, beta, state, state_indices, scale, use_qk_l2norm,
                intermediate_states, update_state, state_layout)
        if o is not None:
            return o
    if _all_torch_tensors(q, k, v, g, beta, state):  # torch: no need to try the hot path twice
        front = _torch_front()
        return (front.recurrent_checked if tried else front.recurrent_call)(
            q, k, v, g, beta, state, state_indices, scale, cu_seqlens, use_qk_l2norm,
            intermediate_states, update_state, state_layout, use_gate_in_kernel, A_log, dt_bias,
            use_beta_sigmoid_in_kernel)
    check_layout(state_layout)
    (q, k, v, g, beta, state, state_indices, cu_seqlens, intermediate_states, A_log,
     dt_bias) = public_arrays(
        [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("state", state),
         ("state_indices", state_indices), ("cu_seqlens", cu_seqlens),
         ("intermediate_states", intermediate_states), ("A_log", A_log), ("dt_bias", dt_bias)],
        required=("q", "k", "v", "g", "beta", "state"))
    fw = common_framework([("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta),
                           ("state", state), ("intermediate_states", intermediate_states),
                           ("A_log", A_log), ("dt_bias", dt_bias)])
    if fw is JAX:
        raise TypeError("state: JAX arrays cannot be updated in place; use "
                        "flashqla.jax.gdn_recurrent, which returns (o, new_state)")
    if fw is TORCH:  # torch.ops.flashqla.recurrent
        return _torch_front().recurrent_call(
            q, k, v, g, beta, state, state_indices, scale, cu_seqlens, use_qk_l2norm,
            intermediate_states, update_state, state_layout, use_gate_in_kernel, A_log, dt_bias,
            use_beta_sigmoid_in_kernel)
    dims = "[P, HV, K, V]" if state_layout == "kv" else "[P, HV, V, K]"
    check_ndim(state, "state", 4, dims)
    check_ndim(intermediate_states, "intermediate_states", 5,
               "[N, Ti, HV, K, V]" if state_layout == "kv" else "[N, Ti, HV, V, K]")
    check_float_dtypes(fw, [("state", state), ("intermediate_states", intermediate_states)])
    fw, q, k, v, g, beta, _, cu = prepare_inputs(q, k, v, g, beta, None, cu_seqlens)
    A_log, dt_bias = prepare_gate_params(fw, q, use_gate_in_kernel, A_log, dt_bias)
    gates = FusedGates(use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel)
    idx = None
    if state_indices is not None:
        idx = fw.index_array(state_indices, q, "state_indices")
        check_ndim(idx, "state_indices", 1, "[N]")
    return recurrent_prepared(fw, q, k, v, g, beta, state, idx, cu, resolve_scale(scale, q),
                              use_qk_l2norm, gates, state_layout, intermediate_states,
                              update_state)


def gdn_commit(state: Array, intermediate_states: Array, state_indices: Optional[Indices],
               num_accepted: Indices, *, state_layout: str = "kv") -> None:
    """The commit of a speculative-verify step: for each sequence n with
    state_indices[n] >= 0 (n itself when state_indices is None) and
    num_accepted[n] > 0, state[state_indices[n]] = intermediate_states[n,
    num_accepted[n] - 1], in place; num_accepted[n] = 0 keeps the slot.

    state [P, HV, K, V]; intermediate_states [N, Ti, HV, K, V] (as written
    by gdn_recurrent(..., intermediate_states=..., update_state=False) from
    its q, k [B, T, H, K], v [B, T, HV, V] and gates [B, T, HV]);
    state_indices, num_accepted [N] int32/int64 (0 <= num_accepted <= Ti: on
    the CPU others raise ValueError; on CUDA, where the host cannot read
    them without a synchronisation, such entries leave their slot as it was).
    No host synchronisation on CUDA: capturable in a CUDA graph together with
    the verify step."""
    hot = _commit_hot  # the verify step's hot path: PyTorch tensors straight to the binding
    if hot is not None and hot(state, intermediate_states, state_indices, num_accepted,
                               state_layout):
        return None
    check_layout(state_layout)
    state, intermediate_states, state_indices, num_accepted = public_arrays(
        [("state", state), ("intermediate_states", intermediate_states),
         ("state_indices", state_indices), ("num_accepted", num_accepted)],
        required=("state", "intermediate_states", "num_accepted"))
    fw = common_framework([("state", state), ("intermediate_states", intermediate_states)])
    if fw is JAX:
        raise TypeError("state: JAX arrays cannot be updated in place")
    if fw is TORCH:  # torch.ops.flashqla.commit
        return _torch_front().gdn_commit(state, intermediate_states, state_indices, num_accepted,
                                         state_layout=state_layout)
    check_ndim(state, "state", 4, "[P, HV, K, V]" if state_layout == "kv" else "[P, HV, V, K]")
    check_ndim(intermediate_states, "intermediate_states", 5,
               "[N, Ti, HV, K, V]" if state_layout == "kv" else "[N, Ti, HV, V, K]")
    idx = None
    if state_indices is not None:
        idx = fw.index_array(state_indices, state, "state_indices")
        check_ndim(idx, "state_indices", 1, "[N]")
    if num_accepted is None:
        raise TypeError("num_accepted: expected an int32/int64 array [N], got None")
    acc = fw.index_array(num_accepted, state, "num_accepted")
    check_ndim(acc, "num_accepted", 1, "[N]")
    commit_prepared(fw, state, intermediate_states, idx, acc, state_layout)


# ------------------------------------------------------ public: FLA names ----

# FLA keyword arguments that only steer how FLA computes (hints, caches,
# its own graph / context-parallel machinery, its chunk size): accepted and ignored.
_FLA_HINTS = ("cu_seqlens_cpu", "chunk_indices", "auto_cp", "enable_fwd_cp_cache", "use_graph",
              "chunk_size")
# FLA keyword arguments that change the operator in ways flashqla does not
# implement: accepted only at their default.
_FLA_DEFAULT_ONLY = {
    "head_first": False,
    "allow_neg_eigval": False,
    "cp_context": None,
}


def fla_chunk_options(**kwargs: Any) -> Dict[str, Any]:
    """The keywords of FLA's chunk_gated_delta_rule past q .. cu_seqlens, as
    gdn_chunk keywords: use_gate_in_kernel, A_log, dt_bias and
    use_beta_sigmoid_in_kernel as they are, state_v_first (or its deprecated
    name transpose_state_layout) as state_layout="vk"; FLA's hints are
    ignored, so is anything FLA does not know either (FLA takes **kwargs); an
    option that changes the operator in a way flashqla does not implement
    raises ValueError naming it."""
    opts = {}
    v_first = bool(kwargs.pop("state_v_first", False))
    if "transpose_state_layout" in kwargs:
        old = bool(kwargs.pop("transpose_state_layout"))
        if old and v_first:
            raise ValueError("transpose_state_layout: pass state_v_first or its deprecated name "
                             "transpose_state_layout, not both")
        v_first = v_first or old
    if v_first:
        opts["state_layout"] = "vk"
    for name in ("use_gate_in_kernel", "use_beta_sigmoid_in_kernel"):
        if kwargs.pop(name, False):
            opts[name] = True
    for name in ("A_log", "dt_bias"):
        x = kwargs.pop(name, None)
        if x is not None and opts.get("use_gate_in_kernel"):
            opts[name] = x
    for name, value in kwargs.items():
        if name in _FLA_DEFAULT_ONLY:
            default = _FLA_DEFAULT_ONLY[name]
            if value is default or (not hasattr(value, "shape") and value == default):
                continue
            shown = "an object" if hasattr(value, "shape") or name == "cp_context" else repr(value)
            raise ValueError(f"{name}: {name}={shown} is not supported by flashqla's "
                             f"chunk_gated_delta_rule (only {name}={default!r})")
        # _FLA_HINTS and any other keyword: ignored, as FLA ignores what it does not know
    return opts


def chunk_gated_delta_rule(q: Array, k: Array, v: Array, g: Array, beta: Array,
                           scale: Optional[float] = None, initial_state: Optional[Array] = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           use_beta_sigmoid_in_kernel: bool = False,
                           allow_neg_eigval: bool = False, state_v_first: bool = False,
                           cu_seqlens: Optional[Indices] = None,
                           cu_seqlens_cpu: Optional[Indices] = None,
                           chunk_indices: Optional[Indices] = None,
                           cp_context: Optional[object] = None,
                           **kwargs: Any) -> Tuple[Array, Optional[Array]]:
    """FLA's `fla.ops.gated_delta_rule.chunk_gated_delta_rule` (0.6.0), the
    same parameters in the same order, so FLA code runs unchanged:
    `from flashqla import chunk_gated_delta_rule`. Returns (o, final_state).
    Shapes as gdn_chunk: q, k [B, T, H, K]; v [B, T, HV, V]; g, beta
    [B, T, HV]; initial_state [N, HV, K, V]; cu_seqlens [N + 1].

    FLA's serving options work as in FLA: use_gate_in_kernel with A_log and
    dt_bias (keywords; g is then the raw a), use_beta_sigmoid_in_kernel (beta
    the raw b), state_v_first (states [N, HV, V, K]). FLA's keywords that only
    steer FLA's own machinery (cu_seqlens_cpu, chunk_indices, chunk_size, ...)
    are ignored; those that change the operator in a way flashqla does not
    implement (head_first=True, allow_neg_eigval=True, cp_context) raise
    ValueError naming them; any other keyword is ignored, as FLA ignores it
    (transformers passes its own, e.g. use_cache)."""
    opts = fla_chunk_options(use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                             allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first,
                             cp_context=cp_context, **kwargs)
    return gdn_chunk(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                     use_qk_l2norm=use_qk_l2norm_in_kernel, **opts)


# keyword options of FLA's fused_recurrent_gated_delta_rule that flashqla
# takes only at their default (they change the operator)
_FLA_RECURRENT_DEFAULT_ONLY = {
    "gk": None,                       # per-key decay [B, T, HV, K]
    "gv": None,                       # per-value decay [B, T, HV, V]
    "allow_neg_eigval": False,
}


def fused_recurrent_gated_delta_rule(q: Array, k: Array, v: Array, g: Optional[Array] = None,
                                     gk: Optional[Array] = None, gv: Optional[Array] = None,
                                     beta: Optional[Array] = None, scale: Optional[float] = None,
                                     initial_state: Optional[Array] = None,
                                     output_final_state: bool = False,
                                     use_qk_l2norm_in_kernel: bool = False,
                                     use_gate_in_kernel: bool = False,
                                     A_log: Optional[Array] = None,
                                     dt_bias: Optional[Array] = None,
                                     use_beta_sigmoid_in_kernel: bool = False,
                                     allow_neg_eigval: bool = False, state_v_first: bool = False,
                                     cu_seqlens: Optional[Indices] = None,
                                     **kwargs: Any) -> Tuple[Array, Optional[Array]]:
    """FLA's `fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule`
    (0.6.0), same arguments in the same order: the token-by-token recurrence
    from initial_state, returning (o [B, T, HV, V], final_state [N, HV, K, V]
    or None unless output_final_state). Functional like FLA's: initial_state
    is left as it was (flashqla.gdn_recurrent on a copy of it); for decoding
    against a state pool in place use gdn_recurrent itself.

    q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV] (g None: no decay;
    beta None: 1); initial_state [N, HV, K, V] (None: zeros); cu_seqlens
    [N + 1] (B == 1). Fused gates (use_gate_in_kernel with A_log, dt_bias;
    use_beta_sigmoid_in_kernel) and state_v_first ([N, HV, V, K] states) as in
    FLA. FLA's options that change the operator and flashqla does not
    implement (gk, gv, allow_neg_eigval, a per-value beta [B, T, HV, V]) raise
    ValueError naming them; other keywords are ignored, as FLA ignores them.
    No gradients (FLA's has none either)."""
    if "transpose_state_layout" in kwargs:  # FLA's deprecated name of state_v_first
        if state_v_first:
            raise ValueError("transpose_state_layout: pass state_v_first or its deprecated name "
                             "transpose_state_layout, not both")
        state_v_first = kwargs.pop("transpose_state_layout")
    given = dict(gk=gk, gv=gv, allow_neg_eigval=allow_neg_eigval)
    layout = "vk" if state_v_first else "kv"
    serving = dict(state_layout=layout, use_gate_in_kernel=bool(use_gate_in_kernel),
                   A_log=A_log if use_gate_in_kernel else None,
                   dt_bias=dt_bias if use_gate_in_kernel else None,
                   use_beta_sigmoid_in_kernel=bool(use_beta_sigmoid_in_kernel))
    for name, value in given.items():
        default = _FLA_RECURRENT_DEFAULT_ONLY[name]
        if value is default or (not hasattr(value, "shape") and value == default):
            continue
        shown = "a tensor" if hasattr(value, "shape") else repr(value)
        raise ValueError(f"{name}: {name}={shown} is not supported by flashqla's "
                         f"fused_recurrent_gated_delta_rule (only {name}={default!r})")
    fw = common_framework([("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta),
                           ("initial_state", initial_state)])
    check_ndim(q, "q", 4, "[B, T, H, K]")
    check_ndim(v, "v", 4, "[B, T, HV, V]")
    if beta is not None and getattr(beta, "ndim", None) == 4:
        raise ValueError("beta: [B, T, HV, V] (one beta per value channel) is not supported by "
                         "flashqla's fused_recurrent_gated_delta_rule (only [B, T, HV])")
    B, T, H, K = (int(s) for s in q.shape)
    HV, V = int(v.shape[2]), int(v.shape[3])
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    if fw is TORCH:
        import torch
        state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        if g is None:
            g = q.new_zeros((B, T, HV), dtype=torch.float32)
        if beta is None:
            beta = q.new_ones((B, T, HV), dtype=torch.float32)
        if initial_state is None:
            pool = q.new_zeros((N, HV) + ((V, K) if state_v_first else (K, V)), dtype=state_dtype)
        else:
            pool = initial_state.detach().to(state_dtype, copy=True).contiguous()
    elif fw is JAX:
        import jax.numpy as jnp
        state_dtype = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
        g = jnp.zeros((B, T, HV), jnp.float32) if g is None else g
        beta = jnp.ones((B, T, HV), jnp.float32) if beta is None else beta
        pool = (jnp.zeros((N, HV) + ((V, K) if state_v_first else (K, V)), state_dtype)
                if initial_state is None else jnp.asarray(initial_state, state_dtype))
        o, pool = _jax_front().gdn_recurrent(q, k, v, g, beta, pool, scale=scale,
                                             cu_seqlens=cu_seqlens,
                                             use_qk_l2norm=use_qk_l2norm_in_kernel, **serving)
        return o, (pool if output_final_state else None)
    else:
        import numpy as np
        xp = np if fw.name == "numpy" else __import__("cupy")
        state_dtype = "float64" if fw.dtype_name(q) == "float64" else "float32"
        g = xp.zeros((B, T, HV), "float32") if g is None else g
        beta = xp.ones((B, T, HV), "float32") if beta is None else beta
        pool = (xp.zeros((N, HV) + ((V, K) if state_v_first else (K, V)), state_dtype)
                if initial_state is None else xp.array(initial_state, dtype=state_dtype, copy=True))
    o = gdn_recurrent(q, k, v, g, beta, pool, scale=scale, cu_seqlens=cu_seqlens,
                      use_qk_l2norm=use_qk_l2norm_in_kernel, **serving)
    return o, (pool if output_final_state else None)
