"""flashqla as a backend of FLA (flash-linear-attention, `fla-core` >= 0.6.0).

    import flashqla.integrations.fla
    flashqla.integrations.fla.register()
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, ...)     # runs flashqla

FLA 0.6.0 picks an implementation of each operation from a backend registry
(`fla.backends`): every call of a dispatched function (for gated_delta_rule:
chunk_gated_delta_rule, and so FLA's GatedDeltaNet layers) asks the enabled
backends, by priority, whether they take it (a verifier) and runs the first
that does, falling back to FLA's Triton kernels. FlashQLA (Qwen's TileLang
kernels) plugs in this way; register() adds flashqla the same way, ahead of
it (priority 2; FlashQLA has 3). Set FLA_FLASHQLA=0 to switch it off again.

flashqla takes a call when its backend can run it: tensors on the CPU, or on
a CUDA device with flashqla's CUDA backend built and K, V in {64, 128}, or
K = V = 256; and
none of the options flashqla does not implement (the ones its
chunk_gated_delta_rule refuses, see flashqla.chunk_gated_delta_rule).
Anything else goes on to the next backend, with FLA's reason logged.
"""

from __future__ import annotations

from typing import Any, Optional

import inspect

import flashqla

__all__ = ["register", "BACKEND_TYPE", "PRIORITY"]

BACKEND_TYPE = "flashqla"
PRIORITY = 2
CUDA_HEAD_DIMS = (64, 128)      # any pair of these, or K = V = 256


def _bind(args, kwargs):
    """FLA's chunk_gated_delta_rule arguments by name (positional ones too)."""
    names = ("q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state",
             "use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval",
             "state_v_first", "cu_seqlens", "cu_seqlens_cpu", "chunk_indices", "cp_context")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


def rejection(*args: Any, **kwargs: Any) -> Optional[str]:
    """Why flashqla cannot run this chunk_gated_delta_rule call (a sentence),
    or None when it can. Reads shapes, dtypes, devices and options only."""
    a = _bind(args, kwargs)
    q, v = a.get("q"), a.get("v")
    if q is None or v is None:
        return "q and v are required"
    if q.device.type == "cuda":
        if not flashqla.cuda_available():
            return "flashqla was built without its CUDA backend"
        K, V = q.shape[-1], v.shape[-1]
        if not (K == V == 256 or (K in CUDA_HEAD_DIMS and V in CUDA_HEAD_DIMS)):
            return (f"flashqla's CUDA backend takes K, V in {CUDA_HEAD_DIMS} or K = V = 256, "
                    f"got K={K}, V={V}")
        if q.dtype.is_floating_point and q.dtype.itemsize == 8:
            return "flashqla's CUDA backend does not take float64"
    elif q.device.type != "cpu":
        return f"flashqla runs on CPU and CUDA tensors, got {q.device.type}"
    try:
        flashqla._api.fla_chunk_options(**{n: a[n] for n in a if n not in (
            "q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state",
            "use_qk_l2norm_in_kernel", "cu_seqlens")})
    except ValueError as e:
        return str(e)
    return None


def register(priority: int = PRIORITY) -> Any:
    """Registers flashqla as a backend of FLA's gated_delta_rule operation
    (needs fla-core >= 0.6.0, with its backend registry). Returns the
    backend object FLA holds; calling it again replaces it."""
    try:
        from fla.backends import BaseBackend, register as fla_register
    except ImportError as e:
        raise ImportError(f"flashqla.integrations.fla.register needs FLA 0.6.0 or newer with its "
                          f"backend registry (pip install fla-core): {e}") from e
    # the operation's registry exists once its backends module was loaded
    import fla.ops.gated_delta_rule  # noqa: F401

    class FlashqlaBackend(BaseBackend):
        """flashqla's chunked forward and backward (CPU and CUDA) for FLA."""

        backend_type = BACKEND_TYPE
        package_name = "flashqla"
        env_var = "FLA_FLASHQLA"
        default_enable = True

        def chunk_gated_delta_rule_verifier(self, *args, **kwargs):
            reason = rejection(*args, **kwargs)
            return reason is None, reason

        def chunk_gated_delta_rule(self, *args, **kwargs):
            return flashqla.chunk_gated_delta_rule(*args, **kwargs)

    FlashqlaBackend.priority = int(priority)
    fla_register("gated_delta_rule")(FlashqlaBackend)
    from fla.backends import _get_operation_registry
    return _get_operation_registry("gated_delta_rule")._backends[BACKEND_TYPE]


def signature_matches_fla() -> bool:
    """True when flashqla.chunk_gated_delta_rule takes FLA's installed
    chunk_gated_delta_rule's parameters in the same order (a check for tests
    and for users upgrading FLA)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_fn
    fla_params = [p for p in inspect.signature(inspect.unwrap(fla_fn)).parameters.values()
                  if p.kind is not p.VAR_KEYWORD]
    ours = inspect.signature(flashqla.chunk_gated_delta_rule).parameters
    positional = [p.name for p in ours.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    n = len(positional)
    return [p.name for p in fla_params[:n]] == positional
