"""flashqla.integrations — flashqla inside other libraries, without glue code.

    flashqla.integrations.fla.register()                  FLA's gated_delta_rule backend
    flashqla.integrations.transformers.apply_to_qwen3_next()   transformers' Qwen3-Next
    flashqla.integrations.transformers.apply_to_qwen3_5()      and Qwen3.5 GDN layers

Each submodule imports its library only when called, so importing flashqla
needs neither.
"""

import importlib

__all__ = ["fla", "transformers"]


def __getattr__(name):
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
