"""Binding-level tests of flashqla._C (csrc/python/module.c).

What is checked here is the binding, not the numbers: DLPack capsules
(versioned and legacy, raw or from __dlpack__), ownership (capsules renamed
used_*, deleters called, reference counts unchanged, no memory growth over
10 000 calls), every validation message and its exception type, that a
rejected call writes nothing, read-only and non-contiguous arrays, devices,
byte_offset, and the small utility functions (the XLA FFI handlers are
tested through flashqla.jax, tests/test_jax.py). Numerical
correctness of the kernels is tested in test_chunk_*.py / test_recurrent.py.

Fake arrays (a CUDA tensor on a machine without a GPU, odd strides,
byte_offset, bad versions) are DLPack capsules built with ctypes below; their
data pointers are never read because validation rejects them first.
"""

import ctypes
import gc
import os
import re
import sys
import threading
import time

import numpy as np
import pytest

from flashqla import _C

try:
    import torch
    import torch.utils.dlpack
except ImportError:  # torch parts are skipped, the rest still runs
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="PyTorch is not installed")

B, T, H, HV, K, V = 2, 70, 2, 4, 16, 16


# --------------------------------------------------------------- inputs ----

def make_inputs(dtype=np.float32, B=B, T=T, H=H, HV=HV, K=K, V=V, N=None, seed=0):
    rng = np.random.default_rng(seed)
    N = B if N is None else N
    q = rng.standard_normal((B, T, H, K)).astype(dtype)
    k = rng.standard_normal((B, T, H, K))
    k = (k / np.linalg.norm(k, axis=-1, keepdims=True)).astype(dtype)
    v = rng.standard_normal((B, T, HV, V)).astype(dtype)
    g = (-np.abs(rng.standard_normal((B, T, HV)))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((B, T, HV))))).astype(np.float32)
    o = np.full((B, T, HV, V), np.nan, dtype)
    h0 = (0.1 * rng.standard_normal((N, HV, K, V))).astype(np.float32)
    ht = np.full((N, HV, K, V), np.nan, np.float32)
    return dict(q=q, k=k, v=v, g=g, beta=beta, o=o, initial_state=h0, final_state=ht)


def fwd(args, **kw):
    a = dict(args)
    a.update(kw)
    pos = [a.pop(n) for n in ("q", "k", "v", "g", "beta", "o")]
    a.setdefault("scale", K ** -0.5)
    return _C.chunk_fwd(*pos, **a)


def make_bwd_inputs(dtype=np.float32):
    a = make_inputs(dtype)
    rng = np.random.default_rng(1)
    del a["o"], a["final_state"]
    a["do"] = rng.standard_normal((B, T, HV, V)).astype(dtype)
    a["dq"] = np.full((B, T, H, K), np.nan, dtype)
    a["dk"] = np.full((B, T, H, K), np.nan, dtype)
    a["dv"] = np.full((B, T, HV, V), np.nan, dtype)
    a["dg"] = np.full((B, T, HV), np.nan, np.float32)
    a["dbeta"] = np.full((B, T, HV), np.nan, np.float32)
    a["dfinal_state"] = rng.standard_normal((B, HV, K, V)).astype(np.float32)
    a["dinitial_state"] = np.full((B, HV, K, V), np.nan, np.float32)
    return a


def bwd(args, **kw):
    a = dict(args)
    a.update(kw)
    pos = [a.pop(n) for n in ("q", "k", "v", "g", "beta", "do", "dq", "dk", "dv", "dg", "dbeta")]
    a.setdefault("scale", K ** -0.5)
    return _C.chunk_bwd(*pos, **a)


def make_rec_inputs(P=None):
    a = make_inputs(T=1)
    pool = a.pop("initial_state")
    del a["final_state"]
    if P is not None:
        pool = np.zeros((P, HV, K, V), np.float32)
    a["state"] = pool
    return a


def rec(args, **kw):
    a = dict(args)
    a.update(kw)
    pos = [a.pop(n) for n in ("q", "k", "v", "g", "beta", "state", "o")]
    a.setdefault("scale", K ** -0.5)
    return _C.recurrent(*pos, **a)


def outputs_of(args):
    names = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state")
    return [args[n] for n in names if n in args and isinstance(args[n], np.ndarray)]


def all_nan(arrays):
    return all(np.isnan(a).all() for a in arrays)


# ------------------------------------------------- ctypes DLPack capsules ---

class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER),
                ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]


_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_NAMES = {True: b"dltensor_versioned", False: b"dltensor"}  # live as long as the module

DTYPES = {"float32": (2, 32), "float64": (2, 64), "float16": (2, 16), "bfloat16": (4, 16),
          "int32": (0, 32), "int64": (0, 64), "uint8": (1, 8)}


class FakeTensor:
    """A DLPack capsule over memory we describe freely. Counts deleter calls;
    keeps every ctypes object alive until the deleter has run."""

    live = {}

    def __init__(self, shape, dtype="float32", device=(1, 0), data=None, strides=None,
                 byte_offset=0, versioned=True, version=(1, 0), flags=0, owner=None):
        self.deleted = 0
        self.owner = owner  # keeps a NumPy array alive when data points into it
        n = len(shape)
        self.shape = (ctypes.c_int64 * max(n, 1))(*shape)
        self.strides = (ctypes.c_int64 * max(n, 1))(*strides) if strides is not None else None
        code, bits = DTYPES[dtype]
        t = DLTensor(data if data is not None else 0x100000, DLDevice(*device), n,
                     DLDataType(code, bits, 1), self.shape,
                     self.strides if self.strides is not None else None, byte_offset)
        self.deleter = DELETER(self._delete)
        if versioned:
            self.m = DLManagedTensorVersioned(DLPackVersion(*version), None, self.deleter, flags, t)
        else:
            self.m = DLManagedTensor(t, None, self.deleter)
        self.versioned = versioned
        FakeTensor.live[id(self)] = self

    def _delete(self, ptr):
        assert ptr == ctypes.addressof(self.m)
        self.deleted += 1
        FakeTensor.live.pop(id(self), None)

    def capsule(self):
        return _PyCapsule_New(ctypes.addressof(self.m), _NAMES[self.versioned], None)


def fake_like(arr, **kw):
    """A capsule over a NumPy array's own memory (same shape and dtype)."""
    kw.setdefault("data", arr.ctypes.data)
    return FakeTensor(arr.shape, str(arr.dtype), owner=arr, **kw)


class DLPackObject:
    """An object with __dlpack__/__dlpack_device__ that records the keywords
    it is called with and hands out a FakeTensor capsule."""

    def __init__(self, fake, device=None, old_protocol=False):
        self.fake = fake
        self.device = device or (fake.m.dl_tensor.device.device_type, fake.m.dl_tensor.device.device_id)
        self.calls = []
        self.old_protocol = old_protocol

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, **kw):
        self.calls.append(kw)
        if self.old_protocol and "max_version" in kw:
            raise TypeError("__dlpack__() got an unexpected keyword argument 'max_version'")
        return self.fake.capsule()


# ------------------------------------------------------------- capsules ----

def test_runs_and_writes_outputs():
    a = make_inputs()
    fwd(a)
    assert np.isfinite(a["o"]).all() and np.isfinite(a["final_state"]).all()


def test_numpy_versioned_capsule_accepted_and_renamed():
    a = make_inputs()
    cap = a["q"].__dlpack__(max_version=(1, 0))
    assert 'dltensor_versioned"' in repr(cap)
    fwd(a, q=cap)
    assert '"used_dltensor_versioned"' in repr(cap)
    assert np.isfinite(a["o"]).all()


@needs_torch
def test_torch_legacy_capsule_accepted_and_renamed():
    a = make_inputs()
    cap = torch.utils.dlpack.to_dlpack(torch.from_numpy(a["q"]))
    assert '"dltensor"' in repr(cap)
    fwd(a, q=cap)
    assert '"used_dltensor"' in repr(cap)
    assert np.isfinite(a["o"]).all()


@needs_torch
def test_torch_tensors_in_and_out_match_numpy():
    a = make_inputs()
    fwd(a)
    t = {n: torch.from_numpy(x.copy()) for n, x in a.items()}
    t["o"].fill_(float("nan"))
    t["final_state"].fill_(float("nan"))
    fwd(t)
    np.testing.assert_array_equal(t["o"].numpy(), a["o"])
    np.testing.assert_array_equal(t["final_state"].numpy(), a["final_state"])


@needs_torch
def test_torch_bfloat16_inputs_run():
    a = make_inputs()
    t = {n: torch.from_numpy(x) for n, x in a.items()}
    for n in ("q", "k", "v"):
        t[n] = t[n].to(torch.bfloat16)
    t["o"] = torch.full((B, T, HV, V), float("nan"), dtype=torch.bfloat16)
    fwd(t)
    assert torch.isfinite(t["o"]).all()


@needs_torch
def test_torch_tensor_requiring_grad_names_the_argument():
    a = make_inputs()
    q = torch.from_numpy(a["q"]).requires_grad_()
    with pytest.raises(TypeError, match=r"^q: __dlpack__\(\) failed: (BufferError|RuntimeError): "):
        fwd(a, q=q)
    assert all_nan(outputs_of(a))


def test_capsule_used_twice_rejected():
    a = make_inputs()
    cap = a["q"].__dlpack__(max_version=(1, 0))
    fwd(a, q=cap)
    with pytest.raises(ValueError, match=r"^q: this DLPack capsule was already consumed"):
        fwd(a, q=cap)


def test_consumed_capsule_deleter_called_after_success_and_failure():
    a = make_inputs()
    for versioned in (True, False):
        f = fake_like(a["q"], versioned=versioned)
        cap = f.capsule()
        fwd(a, q=cap)
        assert f.deleted == 1
        assert "used_dltensor" in repr(cap)
        # failure after the capsule was taken (k has a bad shape): deleter still runs
        f = fake_like(a["q"], versioned=versioned)
        with pytest.raises(ValueError, match=r"^k: expected shape"):
            fwd(a, q=f.capsule(), k=a["k"][:, :, :, :8].copy())
        assert f.deleted == 1


def test_capsule_with_wrong_name_rejected():
    cap = _PyCapsule_New(ctypes.addressof(ctypes.c_int(0)), b"something_else", None)
    with pytest.raises(TypeError, match=r'^q: expected a DLPack capsule named "dltensor" or '
                                        r'"dltensor_versioned", got one named "something_else"'):
        fwd(make_inputs(), q=cap)


def test_newer_major_version_rejected_and_deleted():
    a = make_inputs()
    f = fake_like(a["q"], version=(2, 0))
    with pytest.raises(ValueError, match=r"^q: DLPack version 2\.0 is not supported"):
        fwd(a, q=f.capsule())
    assert f.deleted == 1
    assert all_nan(outputs_of(a))


def test_dlpack_protocol_keywords_cpu_and_cuda():
    a = make_inputs()
    cpu = DLPackObject(fake_like(a["q"]))
    fwd(a, q=cpu)
    assert cpu.calls == [{"max_version": (1, 0)}]  # no stream for a CPU array
    # a CUDA array is asked with the stream (None -> 1, the legacy default stream)
    for stream, expected in ((None, 1), (0, 1), (12345, 12345)):
        cuda = DLPackObject(FakeTensor((B, T, H, K), device=(2, 0)))
        with pytest.raises(ValueError, match=r"^k: on cpu but q is on cuda:0$"):
            fwd(a, q=cuda, stream=stream)
        assert cuda.calls == [{"stream": expected, "max_version": (1, 0)}]
        assert cuda.fake.deleted == 1


def test_producer_without_max_version_gets_a_retry():
    a = make_inputs()
    old = DLPackObject(fake_like(a["q"], versioned=False), old_protocol=True)
    fwd(a, q=old)
    assert old.calls == [{"max_version": (1, 0)}, {}]
    assert old.fake.deleted == 1
    assert np.isfinite(a["o"]).all()


class RaisingProducer:
    def __init__(self, exc, where="__dlpack__"):
        self.exc, self.where = exc, where

    def __dlpack_device__(self):
        if self.where == "__dlpack_device__":
            raise self.exc
        return (1, 0)

    def __dlpack__(self, **kw):
        raise self.exc


def test_producer_errors_name_the_argument():
    a = make_inputs()
    # a producer's failure is TypeError (its TypeError, BufferError: this array
    # cannot be exported as it is) or ValueError (any other Exception), named
    original = BufferError("cannot export")
    with pytest.raises(TypeError, match=r"^v: __dlpack__\(\) failed: BufferError: cannot export$") as info:
        fwd(a, v=RaisingProducer(original))
    assert info.value.__cause__ is original
    with pytest.raises(ValueError, match=r"^g: __dlpack_device__\(\) failed: ValueError: bad device$"):
        fwd(a, g=RaisingProducer(ValueError("bad device"), "__dlpack_device__"))
    with pytest.raises(ValueError, match=r"^beta: __dlpack__\(\) failed: KeyError: 'x'$"):
        fwd(a, beta=RaisingProducer(KeyError("x")))
    with pytest.raises(KeyboardInterrupt):  # no Exception: passes through untouched
        fwd(a, beta=RaisingProducer(KeyboardInterrupt()))
    obj = DLPackObject(FakeTensor((B, T, H, K)), device=("cpu", 0))
    with pytest.raises(TypeError, match=r"^q: __dlpack_device__\(\) must return \(device_type, device_id\)"):
        fwd(a, q=obj)
    assert all_nan(outputs_of(a))


# ------------------------------------------------------- refcount / leaks ---

def test_refcounts_unchanged():
    a = make_inputs()
    fwd(a)  # warm up
    before = {n: sys.getrefcount(x) for n, x in a.items()}
    fwd(a)
    with pytest.raises(ValueError):
        fwd(a, o=a["o"][:1].copy())
    with pytest.raises(TypeError):
        fwd(a, beta=a["beta"].astype(np.float64))
    after = {n: sys.getrefcount(x) for n, x in a.items()}
    assert before == after


@needs_torch
def test_refcounts_unchanged_torch():
    a = {n: torch.from_numpy(x) for n, x in make_inputs().items()}
    fwd(a)
    before = {n: sys.getrefcount(x) for n, x in a.items()}
    for _ in range(3):
        fwd(a)
    with pytest.raises(ValueError):
        fwd(a, v=a["v"][:, :, :3])
    after = {n: sys.getrefcount(x) for n, x in a.items()}
    assert before == after


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_ten_thousand_calls_keep_rss_flat():
    a = make_inputs(B=1, T=4, H=1, HV=1)
    bad_k = a["k"][..., :8].copy()
    idx = np.zeros(1, np.int32)

    def one(i):
        fwd(a)
        if i % 4 == 0:  # failure paths release too
            try:
                fwd(a, k=bad_k)
            except ValueError:
                pass
        if i % 8 == 0:
            cap = a["q"].__dlpack__(max_version=(1, 0))
            fwd(a, q=cap)
        if i % 16 == 0:
            try:
                rec(dict(q=a["q"][:, :1], k=a["k"][:, :1], v=a["v"][:, :1], g=a["g"][:, :1],
                         beta=a["beta"][:, :1], o=a["o"][:, :1], state=a["final_state"]),
                    state_indices=idx)
            except (ValueError, _C.Error):
                pass

    for i in range(500):
        one(i)
    gc.collect()
    start = rss_bytes()
    for i in range(10_000):
        one(i)
    gc.collect()
    grown = rss_bytes() - start
    assert grown < 2 * 1024 * 1024, f"RSS grew by {grown} bytes over 10 000 calls"


# ------------------------------------------------------- validation order ---

def _case(name, make, exc, message):
    return pytest.param(make, exc, message, id=name)


def _fwd_cases():
    i32 = lambda shape: np.zeros(shape, np.int32)  # noqa: E731
    f32 = lambda shape: np.zeros(shape, np.float32)  # noqa: E731
    return [
        # dtype
        _case("q-int", lambda a: dict(q=a["q"].astype(np.int32)), TypeError,
              "q: expected dtype float32, float16, bfloat16 or float64, got int32"),
        _case("k-f64", lambda a: dict(k=a["k"].astype(np.float64)), TypeError,
              "k: expected dtype float32 like q, got float64"),
        _case("v-f16", lambda a: dict(v=a["v"].astype(np.float16)), TypeError,
              "v: expected dtype float32 like q, got float16"),
        _case("o-f64", lambda a: dict(o=a["o"].astype(np.float64)), TypeError,
              "o: expected dtype float32 like q, got float64"),
        _case("g-f16", lambda a: dict(g=a["g"].astype(np.float16)), TypeError,
              "g: expected dtype float32, got float16"),
        _case("beta-f64", lambda a: dict(beta=a["beta"].astype(np.float64)), TypeError,
              "beta: expected dtype float32 like g, got float64"),
        _case("h0-f16", lambda a: dict(initial_state=a["initial_state"].astype(np.float16)), TypeError,
              "initial_state: expected dtype float32 (states are float32; float64 only with "
              "float64 inputs), got float16"),
        _case("h0-f64-with-f32", lambda a: dict(initial_state=a["initial_state"].astype(np.float64)),
              TypeError, "initial_state: expected dtype float32 (states are float32; float64 only "
                         "with float64 inputs), got float64"),
        _case("ht-unlike-h0", lambda a: dict(final_state=a["final_state"].astype(np.float64)),
              TypeError, "final_state: expected dtype float32 like initial_state, got float64"),
        _case("cu-float", lambda a: dict(cu_seqlens=np.array([0, 70], np.float32)), TypeError,
              "cu_seqlens: expected dtype int32 or int64, got float32"),
        # dtype is checked before shape
        _case("dtype-before-shape", lambda a: dict(k=a["k"][:1].astype(np.float64)), TypeError,
              "k: expected dtype float32 like q, got float64"),
        # ndim / shape
        _case("q-3d", lambda a: dict(q=a["q"][0]), ValueError,
              "q: expected a 4-d array [B, T, H, K], got shape [70, 2, 16]"),
        _case("q-0d", lambda a: dict(q=np.array(1.0, np.float32)), ValueError,
              "q: expected a 4-d array [B, T, H, K], got shape []"),
        _case("k-shape", lambda a: dict(k=a["k"][..., :8].copy()), ValueError,
              "k: expected shape [2, 70, 2, 16] like q, got [2, 70, 2, 8]"),
        _case("v-batch", lambda a: dict(v=a["v"][:1].copy()), ValueError,
              "v: expected shape [B=2, T=70, HV, V] (B, T of q), got [1, 70, 4, 16]"),
        _case("hv-not-multiple", lambda a: dict(v=f32((B, T, 3, V)), o=f32((B, T, 3, V)),
                                                g=f32((B, T, 3)), beta=f32((B, T, 3))),
              ValueError, "v: the value heads HV=3 must be a multiple of the q/k heads H=2"),
        _case("g-shape", lambda a: dict(g=a["g"][:, :, :3].copy()), ValueError,
              "g: expected shape [2, 70, 4] ([B, T, HV]), got [2, 70, 3]"),
        _case("beta-shape", lambda a: dict(beta=a["beta"][:, :69].copy()), ValueError,
              "beta: expected shape [2, 70, 4] ([B, T, HV]), got [2, 69, 4]"),
        _case("o-shape", lambda a: dict(o=a["o"][..., :8].copy()), ValueError,
              "o: expected shape [2, 70, 4, 16] like v, got [2, 70, 4, 8]"),
        _case("h0-shape", lambda a: dict(initial_state=a["initial_state"][:1].copy()), ValueError,
              "initial_state: expected shape [2, 4, 16, 16] ([N, HV, K, V]), got [1, 4, 16, 16]"),
        _case("ht-shape", lambda a: dict(final_state=a["final_state"][:, :, :8].copy()), ValueError,
              "final_state: expected shape [2, 4, 16, 16] ([N, HV, K, V]), got [2, 4, 8, 16]"),
        _case("cu-2d", lambda a: dict(cu_seqlens=i32((1, 3))), ValueError,
              "cu_seqlens: expected a 1-d array of N+1 >= 2 offsets, got shape [1, 3]"),
        _case("cu-batch", lambda a: dict(cu_seqlens=np.array([0, 30, 70], np.int32)), ValueError,
              "cu_seqlens: packed sequences need q of batch size 1, got 2"),
        # memory
        _case("noncontiguous", lambda a: dict(q=np.ascontiguousarray(a["q"].transpose(0, 2, 1, 3))
                                              .transpose(0, 2, 1, 3)),
              ValueError, "q: must be C-contiguous (call .contiguous())"),
        _case("o-noncontiguous", lambda a: dict(o=np.full((B, T, HV, 2 * V), np.nan, np.float32)[..., ::2]),
              ValueError, "o: must be C-contiguous (call .contiguous())"),
        # missing / wrong kind
        _case("beta-none", lambda a: dict(beta=None), TypeError,
              "beta: expected an array (an object with __dlpack__, or a DLPack capsule), got None"),
        _case("k-list", lambda a: dict(k=[1.0, 2.0]), TypeError,
              "k: expected an array with __dlpack__ and __dlpack_device__ (NumPy, PyTorch, JAX, "
              "CuPy) or a DLPack capsule, got list"),
        _case("stream-kind", lambda a: dict(stream="0"), TypeError, "stream: expected an int"),
        _case("stream-negative", lambda a: dict(stream=-1), ValueError,
              "stream: expected a non-negative cudaStream_t, got -1"),
        _case("scale-kind", lambda a: dict(scale="x"), TypeError, "scale: expected a float, got str"),
    ]


@pytest.mark.parametrize("make, exc, message", _fwd_cases())
def test_fwd_validation_messages_and_nothing_written(make, exc, message):
    a = make_inputs()
    bad = make(a)
    with pytest.raises(exc) as info:
        fwd(a, **bad)
    assert str(info.value).startswith(message), str(info.value)
    assert type(info.value) is exc
    poisoned = outputs_of(a) + [x for n, x in bad.items() if n in ("o", "final_state")
                                and isinstance(x, np.ndarray) and x.dtype.kind == "f"
                                and np.isnan(x).all()]
    assert all_nan(poisoned)


def test_scale_is_required():
    a = make_inputs()
    with pytest.raises(TypeError, match=r"chunk_fwd\(\) missing required keyword-only argument: 'scale'"):
        _C.chunk_fwd(a["q"], a["k"], a["v"], a["g"], a["beta"], a["o"])
    assert all_nan(outputs_of(a))


def test_read_only_output_rejected_read_only_input_accepted():
    for name in ("o", "final_state"):
        a = make_inputs()
        a[name].flags.writeable = False
        with pytest.raises(ValueError, match=rf"^{name}: is read-only, but flashqla writes it"):
            fwd(a)
        assert all_nan(outputs_of(a))
    a = make_inputs()
    for name in ("q", "k", "v", "g", "beta", "initial_state"):
        a[name].flags.writeable = False
    fwd(a)
    assert np.isfinite(a["o"]).all()


def test_read_only_flag_of_a_versioned_capsule():
    a = make_inputs()
    f = fake_like(a["o"], flags=1)  # DLPACK_FLAG_BITMASK_READ_ONLY
    with pytest.raises(ValueError, match=r"^o: is read-only"):
        fwd(a, o=f.capsule())
    assert f.deleted == 1
    assert np.isnan(a["o"]).all()


def test_device_mismatch_and_unsupported_devices():
    a = make_inputs()
    f = FakeTensor((B, T, H, K), device=(2, 0))
    with pytest.raises(ValueError, match=r"^k: on cuda:0 but q is on cpu$"):
        fwd(a, k=f.capsule())
    assert f.deleted == 1
    f = FakeTensor((B, HV, K, V), device=(2, 1))
    with pytest.raises(ValueError, match=r"^final_state: on cuda:1 but q is on cpu$"):
        fwd(a, final_state=f.capsule())
    # a device that is neither CPU nor CUDA, via capsule and via __dlpack_device__
    f = FakeTensor((B, T, H, K), device=(8, 0))
    with pytest.raises(ValueError, match=r"^q: arrays on DLPack device type 8 \(id 0\) are not supported"):
        fwd(a, q=f.capsule())
    assert f.deleted == 1
    obj = DLPackObject(FakeTensor((B, T, H, K)), device=(8, 0))
    with pytest.raises(ValueError, match=r"^q: arrays on DLPack device type 8 are not supported"):
        fwd(a, q=obj)
    assert obj.calls == []  # __dlpack__ never asked
    assert all_nan(outputs_of(a))


def test_all_cuda_arrays_without_a_usable_gpu():
    """Every argument on (fake) cuda:0: validation passes, then the CUDA
    backend answers: not built (flashqla._C.Error) or, built but this fake
    call has no workspace, a ValueError naming the workspace."""
    a = make_inputs()
    fakes = {n: FakeTensor(x.shape, str(x.dtype), device=(2, 0)) for n, x in a.items()}
    caps = {n: f.capsule() for n, f in fakes.items()}
    need = _C.workspace_bytes("fwd", B, T, H, HV, K, V, B, "float32")
    if not _C.cuda_built():
        with pytest.raises(_C.Error, match="built without CUDA"):
            fwd(caps)
    elif need > 0:
        with pytest.raises(ValueError, match=r"^workspace: this call needs \d+ bytes"):
            fwd(caps)
    else:
        pytest.skip("CUDA build with a zero workspace: would launch on a fake device")
    assert all(f.deleted == 1 for f in fakes.values())


def test_cuda_workspace_validated():
    if not _C.cuda_built():
        pytest.skip("CPU-only build: the workspace is ignored")
    a = make_inputs()
    need = _C.workspace_bytes("fwd", B, T, H, HV, K, V, B, "float32")
    if need == 0:
        pytest.skip("no workspace needed")
    caps = {n: FakeTensor(x.shape, str(x.dtype), device=(2, 0)).capsule() for n, x in a.items()}
    small = FakeTensor((need - 1,), "uint8", device=(2, 0))
    with pytest.raises(ValueError, match=rf"^workspace: needs at least {need} bytes"):
        fwd(caps, workspace=small.capsule())
    caps = {n: FakeTensor(x.shape, str(x.dtype), device=(2, 0)).capsule() for n, x in a.items()}
    wrong = FakeTensor((need,), "float32", device=(2, 0))
    with pytest.raises(TypeError, match=r"^workspace: expected dtype uint8, got float32"):
        fwd(caps, workspace=wrong.capsule())


def test_workspace_ignored_on_cpu():
    a = make_inputs()
    ws = DLPackObject(FakeTensor((16,), "uint8", device=(2, 0)))
    fwd(a, workspace=ws)
    assert ws.calls == []
    assert np.isfinite(a["o"]).all()


def test_strides_of_size_one_dims_are_free_and_byte_offset_is_honoured():
    a = make_inputs()
    fwd(a)
    ref = a["o"].copy()
    # q inside a larger buffer: data = buffer start, byte_offset = where q begins
    pad = 48  # bytes, a multiple of the element size
    big = np.zeros(a["q"].size + pad // 4, np.float32)
    big[pad // 4:] = a["q"].ravel()
    f = FakeTensor(a["q"].shape, data=big.ctypes.data, byte_offset=pad, owner=big)
    o2 = np.full_like(ref, np.nan)
    fwd(a, q=f.capsule(), o=o2)
    np.testing.assert_array_equal(o2, ref)
    # explicit strides, with a nonsense stride on a size-1 dimension
    a1 = make_inputs(B=1)
    fwd(a1)
    ref1 = a1["o"].copy()
    s = [T * H * K, H * K, K, 1]
    f = fake_like(a1["q"], strides=[999] + s[1:])
    o1 = np.full_like(ref1, np.nan)
    fwd(a1, q=f.capsule(), o=o1)
    np.testing.assert_array_equal(o1, ref1)
    # a real non-compact stride is refused
    f = fake_like(a1["q"], strides=[T * H * K, H * K, 1, H])
    with pytest.raises(ValueError, match=r"^q: must be C-contiguous"):
        fwd(a1, q=f.capsule())


def test_malformed_tensors_rejected():
    a = make_inputs()
    cases = [
        (FakeTensor((B, T, H, K), byte_offset=1), "q: data is not aligned to its 4-byte elements (byte_offset 1)"),
        (FakeTensor((B, T, H, K), data=0), None),  # data NULL -> see below
        (FakeTensor((B, -T, H, K)), "q: malformed DLPack tensor (dimension 1 is -70)"),
        (FakeTensor((2 ** 40, 2 ** 40, H, K)), "q: shape [1099511627776, 1099511627776, 2, 16] is too large"),
    ]
    for f, message in cases:
        if f.m.dl_tensor.data is None:
            # ctypes turns a 0 pointer into None: the NULL-pointer case
            message = "q: has a NULL data pointer"
        with pytest.raises(ValueError) as info:
            fwd(a, q=f.capsule())
        assert str(info.value) == message
        assert f.deleted == 1
    assert all_nan(outputs_of(a))


def test_huge_shape_from_numpy_like_shapes_no_crash():
    a = make_inputs()
    # a consistent but enormous batch that does not exist in memory is caught by the shape
    # rules of the other arguments before anything is read
    f = FakeTensor((2 ** 31, T, H, K))
    with pytest.raises(ValueError, match=r"^k: expected shape \[2147483648, 70, 2, 16\] like q"):
        fwd(a, q=f.capsule())


def test_core_value_errors_come_back_as_value_errors():
    a = make_inputs(B=1, N=2)
    a["initial_state"] = a["initial_state"][:2].copy()
    a["final_state"] = np.full((2, HV, K, V), np.nan, np.float32)
    with pytest.raises(ValueError, match=r"^cu_seqlens: must end at the token count T=70, got 60$"):
        fwd(a, cu_seqlens=np.array([0, 30, 60], np.int64))
    with pytest.raises(ValueError, match=r"^cu_seqlens: must be non-decreasing"):
        fwd(a, cu_seqlens=np.array([0, 40, 30], np.int32))
    assert all_nan(outputs_of(a))
    fwd(a, cu_seqlens=np.array([0, 30, 70], np.int32))
    assert np.isfinite(a["o"]).all() and np.isfinite(a["final_state"]).all()


def test_float64_inputs_with_float64_states():
    a = make_inputs(np.float64)
    a["g"] = a["g"].astype(np.float64)
    a["beta"] = a["beta"].astype(np.float64)
    a["initial_state"] = a["initial_state"].astype(np.float64)
    a["final_state"] = a["final_state"].astype(np.float64)
    fwd(a)
    assert np.isfinite(a["o"]).all() and np.isfinite(a["final_state"]).all()


# ------------------------------------------------------------- backward ----

def test_bwd_runs():
    a = make_bwd_inputs()
    bwd(a)
    for n in ("dq", "dk", "dv", "dg", "dbeta", "dinitial_state"):
        assert np.isfinite(a[n]).all(), n


@pytest.mark.parametrize("make, exc, message", [
    _case("dq-shape", lambda a: dict(dq=a["dq"][:, :, :1].copy()), ValueError,
          "dq: expected shape [2, 70, 2, 16] like q, got [2, 70, 1, 16]"),
    _case("dv-dtype", lambda a: dict(dv=a["dv"].astype(np.float64)), TypeError,
          "dv: expected dtype float32 like q, got float64"),
    _case("do-shape", lambda a: dict(do=a["do"][:, :, :2].copy()), ValueError,
          "do: expected shape [2, 70, 4, 16] like v, got [2, 70, 2, 16]"),
    _case("dg-dtype", lambda a: dict(dg=a["dg"].astype(np.float16)), TypeError,
          "dg: expected dtype float32 like g, got float16"),
    _case("dbeta-shape", lambda a: dict(dbeta=a["dbeta"][:1].copy()), ValueError,
          "dbeta: expected shape [2, 70, 4] ([B, T, HV]), got [1, 70, 4]"),
    _case("dht-shape", lambda a: dict(dfinal_state=a["dfinal_state"][:1].copy()), ValueError,
          "dfinal_state: expected shape [2, 4, 16, 16] ([N, HV, K, V]), got [1, 4, 16, 16]"),
    _case("dh0-missing", lambda a: dict(dinitial_state=None), ValueError,
          "dinitial_state: required when initial_state is given"),
    _case("dh0-without-h0", lambda a: dict(initial_state=None), ValueError,
          "dinitial_state: only written when initial_state is given"),
    _case("dq-readonly", lambda a: dict(dq=np.lib.stride_tricks.as_strided(a["dq"], writeable=False)),
          ValueError, "dq: is read-only, but flashqla writes it"),
])
def test_bwd_validation(make, exc, message):
    a = make_bwd_inputs()
    bad = make(a)
    with pytest.raises(exc) as info:
        bwd(a, **bad)
    assert type(info.value) is exc
    assert str(info.value).startswith(message), str(info.value)
    assert all_nan([a[n] for n in ("dq", "dk", "dv", "dg", "dbeta", "dinitial_state")])


# ------------------------------------------------------------ recurrent ----

def test_recurrent_runs_and_updates_the_pool():
    a = make_rec_inputs()
    before = a["state"].copy()
    rec(a)
    assert np.isfinite(a["o"]).all()
    assert not np.array_equal(before, a["state"])


@pytest.mark.parametrize("make, exc, message", [
    _case("pool-shape", lambda a: dict(state=np.zeros((2, HV, K, 8), np.float32)), ValueError,
          "state: expected shape [P, 4, 16, 16] ([P, HV, K, V], P >= 1), got [2, 4, 16, 8]"),
    _case("pool-size", lambda a: dict(state=np.zeros((3, HV, K, V), np.float32)), ValueError,
          "state: without state_indices the pool must have N=2 slots, got shape [3, 4, 16, 16]"),
    _case("pool-dtype", lambda a: dict(state=a["state"].astype(np.float16)), TypeError,
          "state: expected dtype float32"),
    _case("idx-dtype", lambda a: dict(state_indices=np.zeros(2, np.uint8)), TypeError,
          "state_indices: expected dtype int32 or int64, got uint8"),
    _case("idx-shape", lambda a: dict(state_indices=np.zeros(3, np.int32)), ValueError,
          "state_indices: expected shape [2] ([N], one slot per sequence), got [3]"),
    _case("idx-range", lambda a: dict(state_indices=np.array([0, 5], np.int64)), ValueError,
          "state_indices: entry 1 is 5, but the pool has 2 slots"),
    _case("pool-readonly", lambda a: dict(state=np.lib.stride_tricks.as_strided(a["state"], writeable=False)),
          ValueError, "state: is read-only, but flashqla writes it"),
])
def test_recurrent_validation(make, exc, message):
    a = make_rec_inputs()
    bad = make(a)
    pool = a["state"].copy()
    with pytest.raises(exc) as info:
        rec(a, **bad)
    assert type(info.value) is exc
    assert str(info.value).startswith(message), str(info.value)
    assert np.isnan(a["o"]).all()
    np.testing.assert_array_equal(a["state"], pool)


# ------------------------------------- the DLPack C exchange API (1.3) ----

MANAGED_FROM = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p))
DLTENSOR_FROM = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(DLTensor))
WORK_STREAM = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_int32,
                               ctypes.POINTER(ctypes.c_void_p))


class DLPackExchangeAPIHeader(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("prev_api", ctypes.c_void_p)]


class DLPackExchangeAPI(ctypes.Structure):
    _fields_ = [("header", DLPackExchangeAPIHeader), ("managed_tensor_allocator", ctypes.c_void_p),
                ("managed_tensor_from_py_object_no_sync", MANAGED_FROM),
                ("managed_tensor_to_py_object_no_sync", ctypes.c_void_p),
                ("dltensor_from_py_object_no_sync", DLTENSOR_FROM),
                ("current_work_stream", WORK_STREAM)]


_EXCHANGE_NAME = b"dlpack_exchange_api"  # lives as long as the module
_READ_ONLY = 1


def exchange_type(major=1, prev_major=None, non_owning=True, stream=0x5150):
    """A fresh array type (the binding caches per type) whose instances wrap a
    FakeTensor and carry a DLPack C exchange API table made with ctypes: the
    owning export hands out the FakeTensor's own versioned tensor (its deleter
    counted), the non-owning one a copy of its DLTensor. A header of major
    version `major`, with an older table of `prev_major` chained behind it.
    Every call is recorded on the type: ("owning" | "non-owning", name) and
    ("stream", device_type, device_id)."""
    calls = []

    def obj(ptr):
        return ctypes.cast(ptr, ctypes.py_object).value

    def managed(ptr, out):
        x = obj(ptr)
        calls.append(("owning", x.name))
        out[0] = ctypes.addressof(x.fake.m)
        return 0

    def dltensor(ptr, out):
        x = obj(ptr)
        calls.append(("non-owning", x.name))
        out[0] = x.fake.m.dl_tensor
        return 0

    def work_stream(device_type, device_id, out):
        calls.append(("stream", device_type, device_id))
        out[0] = stream
        return 0

    fns = (MANAGED_FROM(managed), DLTENSOR_FROM(dltensor) if non_owning else DLTENSOR_FROM(),
           WORK_STREAM(work_stream))

    def table(m, prev=None):
        return DLPackExchangeAPI(DLPackExchangeAPIHeader(DLPackVersion(m, 0), prev), None, fns[0],
                                 None, fns[1], fns[2])

    older = table(prev_major) if prev_major is not None else None
    api = table(major, ctypes.addressof(older) if older is not None else None)

    class Exchanged(DLPackObject):
        def __init__(self, fake, name):
            super().__init__(fake)
            self.name = name

    Exchanged.__dlpack_c_exchange_api__ = _PyCapsule_New(ctypes.addressof(api), _EXCHANGE_NAME, None)
    Exchanged.calls = calls
    Exchanged.keep = (fns, api, older)  # the table outlives every call
    return Exchanged


def test_exchange_api_takes_arrays_without_dlpack_calls():
    """exchange_api=True: an input comes through the non-owning export, a
    written array through the owning one (its deleter called once), no
    __dlpack__ call, the same bits as plain NumPy arrays; without the flag the
    same objects go through __dlpack__."""
    ref = make_rec_inputs()
    rec(ref)
    for exchange in (True, False):
        a = make_rec_inputs()
        X = exchange_type()
        q, o = X(fake_like(a["q"]), "q"), X(fake_like(a["o"]), "o")
        rec(dict(a, q=q, o=o), exchange_api=exchange)
        np.testing.assert_array_equal(a["o"], ref["o"])
        np.testing.assert_array_equal(a["state"], ref["state"])
        if exchange:
            assert X.calls == [("non-owning", "q"), ("owning", "o")]  # no stream on the CPU
            assert q.calls == [] and o.calls == []
            assert q.fake.deleted == 0 and o.fake.deleted == 1
        else:
            assert X.calls == [] and len(q.calls) == 1 and len(o.calls) == 1
            assert q.fake.deleted == 1 and o.fake.deleted == 1
        assert _C.exchange_api(X)


def test_exchange_api_read_only_flag_and_owning_only_tables():
    """A written array whose owning export says read-only is refused (nothing
    written, its deleter called); a table without the non-owning export gives
    inputs through the owning one; an update_state=False pool is an input."""
    a = make_rec_inputs()
    X = exchange_type()
    o = X(fake_like(a["o"], flags=_READ_ONLY), "o")
    with pytest.raises(ValueError, match=r"^o: is read-only, but flashqla writes it"):
        rec(dict(a, o=o), exchange_api=True)
    assert np.isnan(a["o"]).all() and o.fake.deleted == 1
    a = make_rec_inputs()
    pool = a["state"].copy()
    X = exchange_type(non_owning=False)
    q, s = X(fake_like(a["q"]), "q"), X(fake_like(a["state"], flags=_READ_ONLY), "state")
    rec(dict(a, q=q, state=s), exchange_api=True, update_state=False)
    assert X.calls == [("owning", "q"), ("owning", "state")]
    assert q.fake.deleted == 1 and s.fake.deleted == 1
    np.testing.assert_array_equal(a["state"], pool)
    assert np.isfinite(a["o"]).all()


def test_exchange_api_versions():
    """A table of a newer major version is passed over for the older one it
    chains; one with no major-1 table in its chain is no table (__dlpack__)."""
    for major, prev, taken in ((2, 1, True), (2, None, False), (0, None, False)):
        a = make_rec_inputs()
        X = exchange_type(major=major, prev_major=prev)
        q = X(fake_like(a["q"]), "q")
        rec(dict(a, q=q), exchange_api=True)
        assert _C.exchange_api(X) is taken
        assert (X.calls == [("non-owning", "q")]) is taken and (len(q.calls) == 0) is taken
    with pytest.raises(TypeError, match="^exchange_api: expected a type"):
        _C.exchange_api(1)
    assert not _C.exchange_api(np.ndarray) and not _C.exchange_api(int)


def test_exchange_api_cuda_stream_asked_once_before_any_dlpack_call():
    """On CUDA with stream=None the first array's producer gives the stream
    (asked with its device) before any other array's __dlpack__ is called,
    which then gets that stream; an explicit stream is never replaced. (A
    shape error stops the call before anything could launch on the fake
    device.)"""
    a = make_rec_inputs()
    fakes = {n: FakeTensor(x.shape, str(x.dtype), device=(2, 3)) for n, x in a.items()}
    fakes["k"] = FakeTensor((B, 1, H, K + 1), device=(2, 3))
    X = exchange_type(stream=0x5150)
    q = X(fakes["q"], "q")
    k = DLPackObject(fakes["k"])
    args = dict({n: f.capsule() for n, f in fakes.items()}, q=q, k=k)
    with pytest.raises(ValueError, match=r"^k: expected shape"):
        rec(args, exchange_api=True)
    assert X.calls == [("non-owning", "q"), ("stream", 2, 3)]
    assert k.calls[0]["stream"] == 0x5150
    fakes["k"] = FakeTensor((B, 1, H, K + 1), device=(2, 3))
    k = DLPackObject(fakes["k"])
    args.update(k=k, **{n: fakes[n].capsule() for n in ("v", "g", "beta", "state", "o")})
    with pytest.raises(ValueError, match=r"^k: expected shape"):
        rec(args, exchange_api=True, stream=77)
    assert X.calls[2:] == [("non-owning", "q")] and k.calls[0]["stream"] == 77


@needs_torch
def test_exchange_api_torch_bits_refcounts_and_failures():
    """torch.Tensor's own table (where this torch has one): the same bits as
    capsules, reference counts unchanged over calls and failures, and a
    tensor the producer cannot export named in a ValueError."""
    if not _C.exchange_api(torch.Tensor):
        assert not hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
        pytest.skip("this torch has no DLPack C exchange API")
    a = {n: torch.from_numpy(x) for n, x in make_rec_inputs().items()}
    b = {n: x.clone() for n, x in a.items()}
    rec(a, exchange_api=True)
    rec({n: torch.utils.dlpack.to_dlpack(x) for n, x in b.items()})
    for n in a:
        assert torch.equal(a[n], b[n]), n
    before = {n: sys.getrefcount(x) for n, x in a.items()}
    for _ in range(3):
        rec(a, exchange_api=True)
    with pytest.raises(ValueError, match=r"^k: expected shape"):
        rec(a, k=a["k"][..., :3], exchange_api=True)
    with pytest.raises(ValueError, match=r"^k: DLPack C exchange API export failed: "):
        rec(a, k=torch.empty(a["k"].shape, device="meta"), exchange_api=True)
    with pytest.raises(ValueError, match=r"^o: must be C-contiguous"):
        rec(a, o=torch.empty(a["o"].shape[:-1] + (2 * V,))[..., ::2], exchange_api=True)
    after = {n: sys.getrefcount(x) for n, x in a.items()}
    assert before == after


@needs_torch
def test_exchange_api_commit_equals_capsules():
    """_C.commit(..., exchange_api=True) with torch tensors: the capsules' bits,
    reference counts unchanged over calls and a failure."""
    if not _C.exchange_api(torch.Tensor):
        pytest.skip("this torch has no DLPack C exchange API")
    pool, inter = torch.randn(4, HV, K, V), torch.randn(3, 2, HV, K, V)
    idx, acc = torch.tensor([3, -1, 0], dtype=torch.int32), torch.tensor([1, 2, 2])
    a, b = pool.clone(), pool.clone()
    _C.commit(a, inter, acc, state_indices=idx, exchange_api=True)
    c = torch.utils.dlpack.to_dlpack
    _C.commit(c(b), c(inter), c(acc), state_indices=c(idx))
    assert torch.equal(a, b) and not torch.equal(a, pool)
    args = (a, inter, acc, idx)
    before = [sys.getrefcount(x) for x in args]
    for _ in range(3):
        _C.commit(a, inter, acc, state_indices=idx, exchange_api=True)
    with pytest.raises(ValueError, match=r"^num_accepted: expected shape"):
        _C.commit(a, inter, acc[:2], state_indices=idx, exchange_api=True)
    assert [sys.getrefcount(x) for x in args] == before


def test_recurrent_argument_messages():
    """_C.recurrent parses its own arguments (METH_FASTCALL) with the
    messages of PyArg_ParseTupleAndKeywords, which _C.chunk_fwd still uses."""
    x = np.zeros(1, np.float32)
    cases = [
        ((), {}, "recurrent() missing required argument 'q' (pos 1)"),
        ((x,) * 6, {}, "recurrent() missing required argument 'o' (pos 7)"),
        ((x,) * 8, {}, "recurrent() takes at most 7 positional arguments (8 given)"),
        ((x,) * 7, dict(scale=1.0, bogus=1), "'bogus' is an invalid keyword argument for recurrent()"),
        ((x,) * 7, dict(scale=1.0, q=x), "argument for recurrent() given by name ('q') and position (1)"),
        ((x,) * 7, {"scale": 1.0, 1: 2}, "keywords must be strings"),
        ((x,) * 7, {}, "recurrent() missing required keyword-only argument: 'scale'"),
    ]
    for args, kw, message in cases:
        with pytest.raises(TypeError) as info:
            _C.recurrent(*args, **kw)
        assert str(info.value) == message
    fwd_like = {"q": x, "k": x, "v": x, "g": x, "beta": x}
    with pytest.raises(TypeError) as info:
        _C.chunk_fwd(*fwd_like.values(), x, scale=1.0, bogus=1)
    assert str(info.value) == "'bogus' is an invalid keyword argument for chunk_fwd()"
    with pytest.raises(TypeError) as info:
        _C.commit(x, x)
    assert str(info.value) == "commit() missing required argument 'num_accepted' (pos 3)"
    with pytest.raises(TypeError) as info:
        _C.commit(x, x, x, scale=1.0)
    assert str(info.value) == "'scale' is an invalid keyword argument for commit()"
    with pytest.raises(ValueError, match="truth value"):  # a bad "p" value: its own error
        _C.recurrent(*(x,) * 7, scale=1.0, update_state=np.zeros(2))
    # keywords made at run time (not interned) are matched by their text
    a, b = make_rec_inputs(), make_rec_inputs()
    names = ("q", "k", "v", "g", "beta", "state", "o")
    _C.recurrent(**{"".join([n, ""]): a[n] for n in names}, **{"".join(["sc", "ale"]): 0.25})
    _C.recurrent(*(b[n] for n in names), scale=0.25)
    np.testing.assert_array_equal(a["o"], b["o"])
    np.testing.assert_array_equal(a["state"], b["state"])


# --------------------------------------------------------------- GIL ------

def test_gil_released_during_compute():
    """While one thread computes, another keeps running Python: with the GIL
    held the main thread would stall for the whole compute time."""
    a = make_inputs(B=1, T=16384, H=2, HV=4, K=128, V=128)
    window = {}

    def work():
        window["t0"] = time.perf_counter()
        fwd(a, num_threads=1)
        window["t1"] = time.perf_counter()

    th = threading.Thread(target=work)
    stamps = []
    th.start()
    while th.is_alive():
        stamps.append(time.perf_counter())
    th.join()
    t0, t1 = window["t0"], window["t1"]
    if t1 - t0 < 0.05:
        pytest.skip(f"call too short ({t1 - t0:.4f} s) to observe")
    inside = [t0] + [s for s in stamps if t0 < s < t1] + [t1]
    longest_stall = max(b - a for a, b in zip(inside, inside[1:]))
    assert longest_stall < 0.5 * (t1 - t0), (
        f"main thread stalled {longest_stall:.3f} s during a {t1 - t0:.3f} s call")


# ------------------------------------------------------------- utilities ---

def test_utilities():
    assert isinstance(_C.cuda_built(), bool)
    assert issubclass(_C.Error, RuntimeError)
    n = _C.workspace_bytes("fwd", 1, 128, 2, 4, 64, 64, 1, "bfloat16")
    assert isinstance(n, int) and n >= 0
    if not _C.cuda_built():
        for op in ("fwd", "bwd", "recurrent"):
            assert _C.workspace_bytes(op, B=1, T=128, H=2, HV=4, K=64, V=64, N=1, dtype="float32") == 0
    with pytest.raises(ValueError, match="op: expected"):
        _C.workspace_bytes("nope", 1, 1, 1, 1, 16, 16, 1, "float32")
    with pytest.raises(TypeError, match="dtype: expected"):
        _C.workspace_bytes("fwd", 1, 1, 1, 1, 16, 16, 1, "int8")
    with pytest.raises(ValueError, match="expected B, H, HV, K, V >= 1"):
        _C.workspace_bytes("fwd", 1, 1, 0, 1, 16, 16, 1, "float32")


def test_default_threads_reads_the_environment(monkeypatch):
    monkeypatch.setenv("FLASHQLA_NUM_THREADS", "3")
    assert _C.default_threads() == 3
    monkeypatch.delenv("FLASHQLA_NUM_THREADS")
    assert _C.default_threads() == os.sysconf("SC_NPROCESSORS_ONLN")
