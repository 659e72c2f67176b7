"""Framework adapters: what flashqla needs from NumPy, PyTorch, CuPy and JAX.

Each adapter knows how to name a dtype, make an array contiguous, cast it,
allocate an output of its own framework on the device of another array, and
which CUDA stream and workspace to hand to flashqla._C. Frameworks are
imported only when an array of theirs is passed in, so importing flashqla
needs none of them.
"""

import sys

from . import _C

_STATE_DTYPE = {"float64": "float64"}  # everything else keeps its state in float32


def state_dtype_of(dtype_name):
    return _STATE_DTYPE.get(dtype_name, "float32")


class Framework:
    """Base class; the methods every adapter provides."""

    name = "?"

    def dtype_name(self, x):
        return x.dtype.name

    def is_floating(self, x):
        return self.dtype_name(x) in ("float16", "bfloat16", "float32", "float64")

    def contiguous(self, x):
        raise NotImplementedError

    def astype(self, x, dtype_name):
        raise NotImplementedError

    def index_array(self, x, like, argname):
        """cu_seqlens / state_indices: an int32/int64 array of this framework
        on like's device (lists, tuples and NumPy arrays are converted)."""
        raise NotImplementedError

    def device(self, x):
        """('cpu', 0) or ('cuda', ordinal)."""
        return ("cpu", 0)

    def empty(self, shape, dtype_name, like):
        raise NotImplementedError

    def empty_like(self, x):
        """An uninitialised contiguous array of x's shape, dtype and device."""
        return self.empty(tuple(x.shape), self.dtype_name(x), x)

    def launch(self, op, like, sizes, dtype_name, **options):
        """Keyword arguments stream= and workspace= for a _C call on like's device;
        options: what the workspace size depends on besides the sizes
        (_C.workspace_bytes' keywords: the gate flags)."""
        return {}

    def before_call(self, arrays):
        pass

    def after_call(self, like):
        pass

    def output(self, buf):
        return buf

    def detach(self, x):
        return x

    def export(self, x):
        """What flashqla._C is handed for array x (None stays None): the array
        itself (the binding asks its __dlpack__), or a DLPack capsule."""
        return x


def _workspace_size(op, sizes, dtype_name, options):
    if sizes is None:  # a call without workspace (the commit; the recurrent step without cu_seqlens)
        return 0
    B, T, H, HV, K, V, N = sizes
    return int(_C.workspace_bytes(op, B, T, H, HV, K, V, N, dtype_name, **options))


# ------------------------------------------------------------------ NumPy ----

class NumpyFramework(Framework):
    name = "numpy"

    def contiguous(self, x):
        import numpy as np
        return np.ascontiguousarray(x)

    def astype(self, x, dtype_name):
        return x.astype(dtype_name)

    def index_array(self, x, like, argname):
        return _numpy_index(x, argname)

    def empty(self, shape, dtype_name, like):
        import numpy as np
        return np.empty(shape, dtype=dtype_name)


# ---------------------------------------------------------------- PyTorch ----

class TorchFramework(Framework):
    name = "torch"

    @staticmethod
    def _torch():
        return sys.modules["torch"]  # a torch tensor was seen, so torch is imported

    def dtype_name(self, x):
        return str(x.dtype).replace("torch.", "")

    def is_floating(self, x):
        return x.is_floating_point()

    def contiguous(self, x):
        return x.contiguous()

    def astype(self, x, dtype_name):
        return x.to(getattr(self._torch(), dtype_name))

    def index_array(self, x, like, argname):
        torch = self._torch()
        if isinstance(x, torch.Tensor):
            if x.device != like.device:
                x = x.to(like.device)
            return x.contiguous()
        return torch.as_tensor(_numpy_index(x, argname), device=like.device).contiguous()

    def device(self, x):
        if x.device.type == "cuda":
            idx = x.device.index
            return ("cuda", self._torch().cuda.current_device() if idx is None else idx)
        return (x.device.type, 0)

    def empty(self, shape, dtype_name, like):
        return like.new_empty(shape, dtype=getattr(self._torch(), dtype_name))

    def empty_like(self, x):
        return self._torch().empty_like(x, memory_format=self._torch().contiguous_format)

    def launch(self, op, like, sizes, dtype_name, **options):
        if not like.is_cuda:
            return {}
        torch = self._torch()
        n = _workspace_size(op, sizes, dtype_name, options)
        ws = torch.empty(n, dtype=torch.uint8, device=like.device) if n > 0 else None
        return {"stream": self.cuda_stream(like.get_device()), "workspace": ws}

    _raw_stream = None  # torch's current-stream getter, looked up on the first CUDA call

    def cuda_stream(self, device_index):
        """torch's current CUDA stream on that device as the int flashqla._C
        takes (a cudaStream_t): torch._C._cuda_getCurrentRawStream, which
        torch.compile's generated code calls (a fraction of a microsecond),
        where this PyTorch has it; else torch.cuda.current_stream(), which
        builds a torch.cuda.Stream object per call (several microseconds)."""
        get = self._raw_stream
        if get is None:
            torch = self._torch()
            torch.cuda.init()  # what current_stream() would do first (a no-op once initialised)
            get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            if get is None:
                def get(i):
                    return torch.cuda.current_stream(i).cuda_stream
            self._raw_stream = get
        return get(device_index)

    def detach(self, x):
        return x.detach()

    def export(self, x):
        # A capsule straight from torch (about 1 us, against about 4 us for the
        # __dlpack__ protocol's Python calls). No stream hand-over is needed:
        # flashqla launches on torch's current stream, the one the producer's
        # work is ordered on.
        return None if x is None else _torch_to_dlpack(x)


# ------------------------------------------------------------------- CuPy ----

class CupyFramework(Framework):
    name = "cupy"

    def contiguous(self, x):
        import cupy
        return cupy.ascontiguousarray(x)

    def astype(self, x, dtype_name):
        return x.astype(dtype_name)

    def index_array(self, x, like, argname):
        import cupy
        with like.device:
            if isinstance(x, cupy.ndarray):
                return cupy.ascontiguousarray(x)
            return cupy.asarray(_numpy_index(x, argname))

    def device(self, x):
        return ("cuda", x.device.id)

    def empty(self, shape, dtype_name, like):
        import cupy
        with like.device:
            return cupy.empty(shape, dtype=dtype_name)

    def launch(self, op, like, sizes, dtype_name, **options):
        import cupy
        with like.device:
            n = _workspace_size(op, sizes, dtype_name, options)
            ws = cupy.empty(n, dtype=cupy.uint8) if n > 0 else None
            return {"stream": cupy.cuda.get_current_stream().ptr, "workspace": ws}


# -------------------------------------------------------------------- JAX ----

class JaxFramework(Framework):
    """JAX arrays are computed by flashqla.jax, as XLA custom calls (the XLA
    FFI), never through DLPack: this adapter only tells them apart."""

    name = "jax"


def _numpy_index(x, argname="cu_seqlens / state_indices"):
    """cu_seqlens / state_indices given as a list, tuple or NumPy array: an
    int array (integer-valued floats are converted); booleans, strings,
    objects and fractions raise TypeError naming the argument."""
    import numpy as np
    try:
        a = np.asarray(x)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{argname}: expected a 1-d sequence of integers, got {type(x).__name__} "
                        f"({e})") from e
    if a.dtype.kind == "b":
        raise TypeError(f"{argname}: expected integers (int32/int64), got a boolean array "
                        f"(pass the numbers themselves, not a mask)")
    if a.dtype.kind not in "iu":
        if a.dtype.kind != "f" and a.size:
            raise TypeError(f"{argname}: expected integers (int32/int64), got dtype {a.dtype}")
        if a.size and not np.all(np.isfinite(a) & (a == np.round(a))):
            raise TypeError(f"{argname}: expected integers (int32/int64), got non-integer values "
                            f"of dtype {a.dtype}")
        a = a.astype(np.int64)
    return np.ascontiguousarray(a)


def _torch_to_dlpack(x):
    global _torch_to_dlpack
    from torch.utils.dlpack import to_dlpack
    _torch_to_dlpack = to_dlpack  # looked up once
    return to_dlpack(x)


NUMPY = NumpyFramework()
TORCH = TorchFramework()
CUPY = CupyFramework()
JAX = JaxFramework()


_BY_TYPE = {}  # array type -> adapter, filled on first sight of each type


def framework_of(x, argname):
    """The adapter for array x, or TypeError naming the argument."""
    fw = _BY_TYPE.get(type(x))
    if fw is not None:
        return fw
    root = type(x).__module__.split(".")[0]
    if root == "torch" and "torch" in sys.modules and isinstance(x, sys.modules["torch"].Tensor):
        fw = TORCH
    elif root in ("jax", "jaxlib"):
        fw = JAX
    elif root == "cupy":
        fw = CUPY
    elif root == "numpy" and "numpy" in sys.modules and isinstance(x, sys.modules["numpy"].ndarray):
        fw = NUMPY
    else:
        raise TypeError(f"{argname}: expected a NumPy, PyTorch, JAX or CuPy array, "
                        f"got {type(x).__module__}.{type(x).__name__}")
    _BY_TYPE[type(x)] = fw
    return fw


def common_framework(arrays):
    """arrays: (name, array-or-None) pairs; all non-None must share one
    framework, whose adapter is returned (None when all are None)."""
    fw, first = None, None
    for name, x in arrays:
        if x is None:
            continue
        f = framework_of(x, name)
        if fw is None:
            fw, first = f, name
        elif f is not fw:
            raise TypeError(f"{name}: is a {f.name} array but {first} is a {fw.name} array; "
                            f"pass arrays of one framework")
    return fw


# ---------------------------------------- what every public function checks ----
# Before anything else, so that a bad argument is a TypeError or ValueError
# naming it (issue 9): a required array that is None, an array of no float
# dtype, a scale that is no finite real number; and raw DLPack capsules or
# objects of no known framework with __dlpack__, taken in zero-copy (DESIGN
# §5) as NumPy arrays (CPU, except bfloat16) or PyTorch tensors (CUDA,
# bfloat16; CuPy arrays when only CuPy is installed), whose framework the
# results then come back in.

FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")


def _is_capsule(x):
    return type(x).__name__ == "PyCapsule"


class _CapsuleProducer:
    """A raw DLPack capsule as a __dlpack__ producer (NumPy and CuPy take
    only those); hands the capsule out once."""

    def __init__(self, capsule, device):
        self._capsule, self._device = capsule, device

    def __dlpack_device__(self):
        return self._device

    def __dlpack__(self, **kwargs):
        capsule, self._capsule = self._capsule, None
        return capsule


def _producer_error(argname, what, e):
    kind = TypeError if isinstance(e, (TypeError, BufferError)) else ValueError
    return kind(f"{argname}: {what} failed: {type(e).__name__}: {e}")


def _from_dlpack(x, argname):
    """A raw capsule or a foreign __dlpack__ object -> NumPy array or PyTorch
    tensor (CuPy array) over the same memory."""
    if _is_capsule(x):
        try:
            dev_type, dev_id, dtype = _C.dlpack_info(x)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{argname}: {e}") from e
        src = _CapsuleProducer(x, (dev_type, dev_id))
    else:
        try:
            dev = x.__dlpack_device__()
        except Exception as e:  # noqa: BLE001 (any producer failure names the argument)
            raise _producer_error(argname, "__dlpack_device__()", e) from e
        if not (isinstance(dev, tuple) and len(dev) == 2
                and all(isinstance(d, int) and not isinstance(d, bool) for d in dev)):
            raise TypeError(f"{argname}: __dlpack_device__() must return (device_type, device_id), "
                            f"got {dev!r}")
        (dev_type, dev_id), dtype, src = dev, None, x
    if dev_type not in (1, 2):
        raise ValueError(f"{argname}: arrays on DLPack device type {dev_type} are not supported "
                         f"(only CPU = 1 and CUDA = 2)")
    try:
        if dev_type == 1 and dtype != "bfloat16":
            import numpy as np
            try:
                return np.from_dlpack(src)
            except (TypeError, BufferError, RuntimeError) as e:
                # NumPy has no bfloat16: an object that did not say its dtype
                if _is_capsule(x) or not _have("torch"):
                    raise
                del e
        if _have("torch"):
            import torch
            return torch.from_dlpack(x)
        if dev_type == 2 and _have("cupy"):
            import cupy
            return cupy.from_dlpack(src)
    except Exception as e:  # noqa: BLE001
        raise _producer_error(argname, "__dlpack__()", e) from e
    raise TypeError(f"{argname}: a DLPack array on {'CUDA' if dev_type == 2 else 'the CPU'} "
                    f"of dtype {dtype or 'bfloat16'} needs PyTorch (or CuPy) installed to hold it "
                    f"and the results")


def _have(module):
    if module in sys.modules:
        return True
    import importlib.util
    return importlib.util.find_spec(module) is not None


def _known(x):
    try:
        framework_of(x, "")
        return True
    except TypeError:
        return False


def public_arrays(arrays, required):
    """arrays: (name, value) pairs of one public call; required: the names
    that must not be None. Returns the values, DLPack capsules and foreign
    __dlpack__ objects taken in (see above)."""
    out = []
    for name, x in arrays:
        if x is None:
            if name in required:
                raise TypeError(f"{name}: expected an array (NumPy, PyTorch, JAX, CuPy or any "
                                f"DLPack producer), got None")
        elif _is_capsule(x) or (hasattr(x, "__dlpack__") and not _known(x)):
            x = _from_dlpack(x, name)
        out.append(x)
    return out


def check_float_dtypes(fw, arrays):
    """TypeError naming the first array of (name, array) whose dtype is no float."""
    for name, x in arrays:
        if x is not None and fw.dtype_name(x) not in FLOAT_DTYPES:
            raise TypeError(f"{name}: expected dtype float32, float16, bfloat16 or float64, "
                            f"got {fw.dtype_name(x)}")


def scale_of(scale, q):
    """The scale a call uses: K ** -0.5 for None, else a finite real number."""
    if scale is None:
        K = int(q.shape[-1]) if len(q.shape) else 0
        if K < 1:
            raise ValueError(f"q: expected head dim K >= 1 in [B, T, H, K], got shape "
                             f"{list(q.shape)}")
        return float(K) ** -0.5
    if isinstance(scale, (bool, complex, str, bytes)) or not hasattr(scale, "__float__"):
        raise TypeError(f"scale: expected a real number or None, got {type(scale).__name__}")
    try:
        value = float(scale)
    except (TypeError, ValueError) as e:
        raise TypeError(f"scale: expected a real number or None, got {scale!r} ({e})") from e
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"scale: expected a finite number, got {value}")
    return value
