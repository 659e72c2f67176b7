"""flashqla — Gated DeltaNet (gated delta rule) linear-attention kernels.

    o, ht = flashqla.gdn_chunk(q, k, v, g, beta, initial_state=h0,
                               output_final_state=True)      # prefill / training
    o = flashqla.gdn_recurrent(q, k, v, g, beta, state_pool,
                               state_indices=slots)          # decode, in place

Arrays may be NumPy, PyTorch (CPU or CUDA), JAX or CuPy; results come back in
the caller's framework. See README.md for shapes and the full API.

Submodules loaded on first use: flashqla.jax (jax.custom_vjp wrappers),
flashqla.distributed (context parallelism over torch.distributed),
flashqla.reference (float64 NumPy reference), flashqla.demo (benchmark/demo).
"""

import importlib

try:
    from . import _C
except ImportError as _err:
    # A source checkout whose flashqla/ holds no built extension shadows the
    # installed package when Python runs from the repository root (as in
    # `pip install . && python -m flashqla.demo`): take _C from the installed
    # copy of this package.
    import pkgutil
    __path__ = pkgutil.extend_path(__path__, __name__)
    try:
        from . import _C
    except ImportError:
        raise ImportError(
            f"flashqla._C, the compiled extension, cannot be loaded ({_err}); install "
            f"flashqla with `pip install .`, or build it in place with "
            f"`python setup.py build_ext --inplace`") from _err
from ._C import Error
from ._api import (ChunkContext, chunk_gated_delta_rule, fused_recurrent_gated_delta_rule,
                   gdn_chunk, gdn_chunk_bwd, gdn_chunk_fwd, gdn_commit, gdn_recurrent)

__version__ = "0.1.0"

__all__ = ["gdn_chunk", "gdn_chunk_fwd", "gdn_chunk_bwd", "gdn_recurrent", "gdn_commit",
           "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "ChunkContext", "Error",
           "cuda_available"]

_SUBMODULES = ("jax", "distributed", "integrations", "reference", "demo")


def cuda_available() -> bool:
    """True when this build has the CUDA backend (a device may still be absent).
    Takes no arrays; the kernels' shapes: q, k [B, T, H, K], v [B, T, HV, V],
    g, beta [B, T, HV] (see flashqla.gdn_chunk)."""
    return bool(_C.cuda_built())


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
