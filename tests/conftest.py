"""pytest configuration: the `gpu` marker.

Tests marked `gpu` need a CUDA device, PyTorch with CUDA and a flashqla built
with its CUDA backend; without any of them they are skipped (with the reason),
never failed and never turned into warnings.
"""

import pytest


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA device and a flashqla built with the CUDA backend")


def _gpu_skip_reason():
    try:
        from flashqla import _C
    except ImportError as e:  # the extension itself is missing: a real failure elsewhere
        return f"flashqla._C not importable ({e})"
    if not _C.cuda_built():
        return "flashqla was built without the CUDA backend"
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    reason = _gpu_skip_reason()
    if reason is None:
        return
    marker = pytest.mark.skip(reason=reason)
    for item in gpu_items:
        item.add_marker(marker)
