"""The types of flashqla's public signatures (PEP 484 hints; py.typed ships
them). flashqla takes the arrays of several frameworks and gives back those
of the caller's, so an array is any of them."""

from typing import Any, Sequence, Union

# A NumPy ndarray, PyTorch Tensor, JAX Array or CuPy ndarray (an object with
# __dlpack__ / __dlpack_device__); results are of the inputs' framework.
Array = Any

# cu_seqlens / state_indices: an int32 / int64 array of the inputs' framework,
# or a sequence of ints (converted).
Indices = Union[Array, Sequence[int]]

__all__ = ["Array", "Indices"]
