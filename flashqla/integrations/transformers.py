"""flashqla in transformers' Gated DeltaNet layers (Qwen3-Next, Qwen3.5).

    from transformers import Qwen3NextForCausalLM
    import flashqla.integrations.transformers as fq_tf
    fq_tf.apply_to_qwen3_next()          # before or after the model is built
    model = Qwen3NextForCausalLM(config)
    loss = model(input_ids, labels=labels).loss      # prefill / training: flashqla
    tokens = model.generate(input_ids)               # cached decoding: flashqla

The way liger-kernel's apply_liger_kernel_to_* functions work: transformers'
modeling module calls two module-level functions in every GatedDeltaNet
layer's forward, torch_chunk_gated_delta_rule (prefill, training, chunked
continuation) and torch_recurrent_gated_delta_rule (one new token against
the cached state). apply_to_*() replaces both, in the model family's
modeling module, by flashqla.chunk_gated_delta_rule and
flashqla.fused_recurrent_gated_delta_rule, which take FLA's arguments
(transformers calls them with FLA's signature) and ignore the keywords that
are not theirs. Every layer built from that module, before or after the
call, then runs flashqla; the conv1d, the gated RMSNorm and the projections
stay transformers'. revert_*() puts the previous functions back.

Decoding keeps transformers' cache: the recurrent function returns the new
state (float32 [B, HV, K, V]) and transformers stores it, as with FLA.
"""

from __future__ import annotations

from typing import List

import importlib

import flashqla

__all__ = ["apply_to_qwen3_next", "apply_to_qwen3_5", "revert_qwen3_next", "revert_qwen3_5",
           "MODULES"]

# model family -> its transformers modeling modules (the ones present are patched)
MODULES = {
    "qwen3_next": ("transformers.models.qwen3_next.modeling_qwen3_next",),
    "qwen3_5": ("transformers.models.qwen3_5.modeling_qwen3_5",
                "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"),
}
_FUNCTIONS = {
    "torch_chunk_gated_delta_rule": flashqla.chunk_gated_delta_rule,
    "torch_recurrent_gated_delta_rule": flashqla.fused_recurrent_gated_delta_rule,
}
_saved = {}  # module name -> {function name: what was there before}


def _apply(family, chunk, recurrent):
    patched = []
    for name in MODULES[family]:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        missing = [f for f in _FUNCTIONS if not hasattr(module, f)]
        if missing:
            raise RuntimeError(f"flashqla.integrations.transformers: {name} has no {missing}; this "
                               f"transformers version calls its GatedDeltaNet kernels differently")
        saved = _saved.setdefault(name, {})
        for fname, fn in _FUNCTIONS.items():
            if (fname == "torch_chunk_gated_delta_rule" and not chunk) or \
                    (fname == "torch_recurrent_gated_delta_rule" and not recurrent):
                continue
            if getattr(module, fname) is not fn:
                saved.setdefault(fname, getattr(module, fname))
                setattr(module, fname, fn)
        patched.append(name)
    if not patched:
        raise ImportError(f"flashqla.integrations.transformers: the installed transformers has none "
                          f"of {list(MODULES[family])} (pip install 'transformers>=5')")
    return patched


def _revert(family):
    for name in MODULES[family]:
        saved = _saved.pop(name, None)
        if not saved:
            continue
        module = importlib.import_module(name)
        for fname, fn in saved.items():
            setattr(module, fname, fn)


def apply_to_qwen3_next(chunk: bool = True, recurrent: bool = True) -> List[str]:
    """Runs flashqla in transformers' Qwen3-Next GatedDeltaNet layers: the
    chunked forward/backward (chunk=True) and the cached decoding step
    (recurrent=True). Returns the patched module names."""
    return _apply("qwen3_next", chunk, recurrent)


def apply_to_qwen3_5(chunk: bool = True, recurrent: bool = True) -> List[str]:
    """The same for Qwen3.5 (dense and MoE), where the installed transformers
    has them. Returns the patched module names."""
    return _apply("qwen3_5", chunk, recurrent)


def revert_qwen3_next() -> None:
    """Puts back what apply_to_qwen3_next replaced."""
    _revert("qwen3_next")


def revert_qwen3_5() -> None:
    """Puts back what apply_to_qwen3_5 replaced."""
    _revert("qwen3_5")
