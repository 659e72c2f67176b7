"""The public Python API (flashqla.gdn_chunk & co.) on the CPU: NumPy and
PyTorch interop (outputs of the caller's framework), autograd, the
framework-neutral forward/backward pair, FLA's chunk_gated_delta_rule, and
every bad-input case raising the documented exception."""

import subprocess
import sys

import numpy as np
import pytest

import flashqla
from gdn_testing import (GRAD_NAMES, assert_close, cast_inputs_torch, make_inputs,
                         reference_of, to_f64, tolerance)

TOL32 = tolerance("float32", "o")


def _np32(inp):
    return {n: (None if x is None else (x if n == "cu_seqlens" else x.astype(np.float32)))
            for n, x in inp.items()}


# ------------------------------------------------------------------ NumPy ----

def test_numpy_forward_returns_numpy():
    inp = make_inputs(2, 70, 2, 4, 16, 16, seed=1)
    a = _np32(inp)
    o, ht = flashqla.gdn_chunk(a["q"], a["k"], a["v"], a["g"], a["beta"],
                               initial_state=a["h0"], output_final_state=True)
    assert type(o) is np.ndarray and o.dtype == np.float32 and o.shape == (2, 70, 4, 16)
    assert type(ht) is np.ndarray and ht.dtype == np.float32 and ht.shape == (2, 4, 16, 16)
    ref = reference_of(a, grads=False)
    assert_close("o", o, ref["o"], TOL32)
    assert_close("final_state", ht, ref["ht"], TOL32)
    o2, none = flashqla.gdn_chunk(a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=a["h0"])
    assert none is None
    np.testing.assert_array_equal(o2, o)


def test_numpy_fwd_bwd_pair():
    inp = make_inputs(1, 100, 1, 2, 16, 16, seed=2, seqlens=[30, 70], dht=True)
    a = _np32(inp)
    o, ht, ctx = flashqla.gdn_chunk_fwd(a["q"], a["k"], a["v"], a["g"], a["beta"],
                                        initial_state=a["h0"], output_final_state=True,
                                        cu_seqlens=list(inp["cu_seqlens"]))
    assert isinstance(ctx, flashqla.ChunkContext) and "numpy" in repr(ctx)
    grads = flashqla.gdn_chunk_bwd(ctx, a["do"], a["dht"])
    ref = reference_of(a)
    assert_close("o", o, ref["o"], TOL32)
    assert_close("final_state", ht, ref["ht"], TOL32)
    for name, g in zip(GRAD_NAMES, grads):
        assert type(g) is np.ndarray and g.dtype == np.float32
        assert_close(name, g, ref[name], TOL32)


def test_fwd_bwd_pair_without_initial_state():
    inp = make_inputs(2, 20, 1, 2, 16, 16, seed=3, h0=False)
    a = _np32(inp)
    o, ht, ctx = flashqla.gdn_chunk_fwd(a["q"], a["k"], a["v"], a["g"], a["beta"])
    assert ht is None
    grads = flashqla.gdn_chunk_bwd(ctx, a["do"])
    assert grads[5] is None
    ref = reference_of(a)
    for name, g in zip(GRAD_NAMES[:5], grads[:5]):
        assert_close(name, g, ref[name], TOL32)


def test_numpy_non_contiguous_inputs_and_gate_casts():
    inp = make_inputs(1, 40, 2, 2, 16, 16, seed=4)
    a = _np32(inp)
    # q, k as transposed views of [B, H, T, K] arrays; g in float16, beta float64
    qT = np.ascontiguousarray(a["q"].transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    kT = np.ascontiguousarray(a["k"].transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    assert not qT.flags.c_contiguous
    g16 = a["g"].astype(np.float16)
    o, _ = flashqla.gdn_chunk(qT, kT, a["v"], g16, inp["beta"], initial_state=inp["h0"])
    assert o.dtype == np.float32
    ref = reference_of(dict(a, g=g16.astype(np.float64)), grads=False)
    assert_close("o", o, ref["o"], TOL32)


def test_default_scale_is_rsqrt_K():
    inp = make_inputs(1, 10, 1, 1, 16, 32, seed=5)
    a = _np32(inp)
    o1, _ = flashqla.gdn_chunk(a["q"], a["k"], a["v"], a["g"], a["beta"])
    o2, _ = flashqla.gdn_chunk(a["q"], a["k"], a["v"], a["g"], a["beta"], scale=16 ** -0.5)
    o3, _ = flashqla.gdn_chunk(a["q"], a["k"], a["v"], a["g"], a["beta"], scale=1.0)
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_allclose(o3 * 16 ** -0.5, o1, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- PyTorch ----

torch_only = pytest.mark.skipif("torch" not in sys.modules and
                                __import__("importlib").util.find_spec("torch") is None,
                                reason="PyTorch not installed")


@torch_only
@pytest.mark.parametrize("dtype,gate", [("float32", "float32"), ("bfloat16", "bfloat16"),
                                        ("bfloat16", "float32"), ("float16", "float16")])
def test_torch_autograd_matches_reference(dtype, gate):
    import torch
    inp = make_inputs(1, 130, 2, 4, 32, 32, seed=6, seqlens=[1, 64, 65], dht=True)
    t = cast_inputs_torch(inp, dtype, gate)
    leaves = {n: t[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "h0")}
    o, ht = flashqla.gdn_chunk(leaves["q"], leaves["k"], leaves["v"], leaves["g"],
                               leaves["beta"], initial_state=leaves["h0"],
                               output_final_state=True, cu_seqlens=t["cu_seqlens"])
    assert isinstance(o, torch.Tensor) and o.dtype == t["q"].dtype and o.requires_grad
    assert ht.dtype == torch.float32
    ((o.float() * t["do"].float()).sum() + (ht * t["dht"]).sum()).backward()
    ref = reference_of(t)
    assert_close("o", o, ref["o"], tolerance(dtype, "o"))
    assert_close("final_state", ht, ref["ht"], tolerance(dtype, "ht"))
    for name, leaf in zip(GRAD_NAMES, leaves.values()):
        assert leaf.grad.dtype == leaf.dtype, f"{name}: gradient dtype {leaf.grad.dtype}"
        assert_close(name, leaf.grad, ref[name], tolerance(dtype, name))


@torch_only
def test_torch_mixed_gate_dtypes_are_cast_and_grads_cast_back():
    import torch
    inp = make_inputs(1, 50, 1, 2, 16, 16, seed=7)
    t = cast_inputs_torch(inp, "float32")
    g = t["g"].half().requires_grad_()          # float16 g, float32 beta: both go as float32
    beta = t["beta"].double().requires_grad_()  # float64 beta with float32 q: cast too
    q = t["q"].clone().requires_grad_()
    h0 = t["h0"].half().requires_grad_()        # a float16 state is cast to float32
    o, _ = flashqla.gdn_chunk(q, t["k"], t["v"], g, beta, initial_state=h0)
    (o * t["do"]).sum().backward()
    assert g.grad.dtype == torch.float16 and beta.grad.dtype == torch.float64
    assert h0.grad.dtype == torch.float16 and q.grad.dtype == torch.float32
    ref = reference_of(dict(t, g=g, beta=beta, h0=h0))
    assert_close("dq", q.grad, ref["dq"], TOL32)
    assert_close("dbeta", beta.grad, ref["dbeta"], TOL32)
    assert_close("dg", g.grad, ref["dg"], 1e-3)     # float16 rounding of dg itself
    assert_close("dh0", h0.grad, ref["dh0"], 1e-3)  # float16 rounding of dh0 itself


@torch_only
def test_torch_only_final_state_used_and_non_contiguous():
    import torch
    inp = make_inputs(2, 70, 2, 2, 16, 16, seed=8, dht=True)
    t = cast_inputs_torch(inp, "float32")
    # k given as a transposed view; only the final state enters the loss
    k_bhtk = t["k"].transpose(1, 2).contiguous().requires_grad_()
    k = k_bhtk.transpose(1, 2)
    v = t["v"].clone().requires_grad_()
    _, ht = flashqla.gdn_chunk(t["q"], k, v, t["g"], t["beta"], initial_state=t["h0"],
                               output_final_state=True)
    (ht * t["dht"]).sum().backward()
    ref = reference_of(dict(t, do=np.zeros(inp["do"].shape)))
    assert_close("dk", k_bhtk.grad.transpose(1, 2), ref["dk"], TOL32)
    assert_close("dv", v.grad, ref["dv"], TOL32)


@torch_only
def test_torch_no_grad_and_plain_tensors():
    import torch
    inp = make_inputs(1, 20, 1, 2, 16, 16, seed=9)
    t = cast_inputs_torch(inp, "float32")
    q = t["q"].clone().requires_grad_()
    with torch.no_grad():
        o, _ = flashqla.gdn_chunk(q, t["k"], t["v"], t["g"], t["beta"])
    assert not o.requires_grad
    o2, _ = flashqla.gdn_chunk(t["q"], t["k"], t["v"], t["g"], t["beta"])
    assert torch.equal(o, o2)


@torch_only
def test_chunk_gated_delta_rule_is_fla_compatible():
    import torch
    from flashqla import chunk_gated_delta_rule
    inp = make_inputs(1, 90, 2, 4, 16, 16, seed=10, seqlens=[40, 50], normalize_qk=False)
    t = cast_inputs_torch(inp, "bfloat16")
    # FLA 0.6.0's positional order: q, k, v, g, beta, scale, initial_state, output_final_state,
    # use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
    # cu_seqlens
    o, ht = chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], None, t["h0"],
                                   True, True, False, False, False, t["cu_seqlens"])
    o2, ht2 = flashqla.gdn_chunk(t["q"], t["k"], t["v"], t["g"], t["beta"],
                                 initial_state=t["h0"], output_final_state=True,
                                 use_qk_l2norm=True, cu_seqlens=t["cu_seqlens"])
    assert torch.equal(o, o2) and torch.equal(ht, ht2)
    ref = reference_of(t, use_qk_l2norm=True, grads=False)
    assert_close("o", o, ref["o"], tolerance("bfloat16", "o"))
    # harmless FLA keywords are accepted, the rest refused clearly
    o3, none = chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"],
                                      initial_state=t["h0"], use_qk_l2norm_in_kernel=True,
                                      cu_seqlens=t["cu_seqlens"], head_first=False,
                                      cu_seqlens_cpu=t["cu_seqlens"].cpu())
    assert none is None and torch.equal(o3, o)
    with pytest.raises(ValueError, match="head_first"):
        chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], head_first=True)
    with pytest.raises(ValueError, match="allow_neg_eigval"):
        chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"],
                               use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    # any other keyword is ignored, as FLA ignores it (transformers passes use_cache & co.)
    o4, _ = chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"],
                                   initial_state=t["h0"], use_qk_l2norm_in_kernel=True,
                                   cu_seqlens=t["cu_seqlens"], use_cache=True, position_ids=None)
    assert torch.equal(o4, o)


# ------------------------------------------------------------- bad inputs ----

def _bad_base():
    inp = make_inputs(2, 8, 2, 4, 16, 16, seed=11)
    return _np32(inp)


def _with(**changes):
    def make():
        a = _bad_base()
        a.update({n: (f(a) if callable(f) else f) for n, f in changes.items()})
        return a
    return make


BAD_CHUNK_INPUTS = [
    ("q-int32", _with(q=lambda a: a["q"].astype(np.int32)), TypeError, "q"),
    ("k-dtype-differs", _with(k=lambda a: a["k"].astype(np.float64)), TypeError, "k"),
    ("v-dtype-differs", _with(v=lambda a: a["v"].astype(np.float16)), TypeError, "v"),
    ("g-int", _with(g=lambda a: a["g"].astype(np.int32), beta=lambda a: a["beta"].astype(np.int32)),
     TypeError, "g|beta"),
    ("k-shape", _with(k=lambda a: np.zeros((2, 8, 2, 32), np.float32)), ValueError, "k"),
    ("v-T-mismatch", _with(v=lambda a: a["v"][:, :7].copy()), ValueError, "v"),
    ("HV-not-multiple-of-H", _with(v=lambda a: a["v"][:, :, :3].copy(),
                                   g=lambda a: a["g"][:, :, :3].copy(),
                                   beta=lambda a: a["beta"][:, :, :3].copy()), ValueError, "HV"),
    ("g-shape", _with(g=lambda a: a["g"][:, :, :2].copy()), ValueError, "g"),
    ("q-3d", _with(q=lambda a: a["q"][0].copy()), ValueError, "q"),
    ("h0-shape", _with(h0=lambda a: a["h0"][:1].copy()), ValueError, "initial_state"),
    ("h0-int", _with(h0=lambda a: a["h0"].astype(np.int64)), TypeError, "initial_state"),
    ("K-unsupported", _with(q=lambda a: np.ones((2, 8, 2, 8), np.float32) / 8 ** 0.5,
                            k=lambda a: np.ones((2, 8, 2, 8), np.float32) / 8 ** 0.5, h0=None),
     ValueError, "K"),
    ("V-unsupported", _with(v=lambda a: np.ones((2, 8, 4, 300), np.float32), h0=None),
     ValueError, "V"),
    ("q-not-an-array", _with(q=lambda a: a["q"].tolist()), TypeError, "q"),
]

BAD_CU_SEQLENS = [
    ("not-increasing", [0, 5, 3, 8], ValueError, "cu_seqlens"),
    ("not-ending-at-T", [0, 4, 6], ValueError, "cu_seqlens"),
    ("not-starting-at-0", [1, 4, 8], ValueError, "cu_seqlens"),
    ("float", np.array([0.5, 8.0]), TypeError, "cu_seqlens"),
    ("2d", np.array([[0, 8]]), ValueError, "cu_seqlens"),
]


@pytest.mark.parametrize("name,make,exc,match", BAD_CHUNK_INPUTS,
                         ids=[c[0] for c in BAD_CHUNK_INPUTS])
def test_bad_inputs_raise(name, make, exc, match):
    a = make()
    with pytest.raises(exc, match=match):
        flashqla.gdn_chunk(a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=a["h0"],
                           output_final_state=True)
    with pytest.raises(exc, match=match):
        flashqla.gdn_chunk_fwd(a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=a["h0"])


@pytest.mark.parametrize("name,cu,exc,match", BAD_CU_SEQLENS, ids=[c[0] for c in BAD_CU_SEQLENS])
def test_bad_cu_seqlens_raise(name, cu, exc, match):
    a = make_inputs(1, 8, 1, 2, 16, 16, seed=12, h0=False)
    a = _np32(a)
    with pytest.raises(exc, match=match):
        flashqla.gdn_chunk(a["q"], a["k"], a["v"], a["g"], a["beta"], cu_seqlens=cu)


def test_cu_seqlens_needs_batch_1():
    a = _bad_base()
    with pytest.raises(ValueError, match="cu_seqlens"):
        flashqla.gdn_chunk(a["q"], a["k"], a["v"], a["g"], a["beta"], cu_seqlens=[0, 8])


def test_cu_seqlens_initial_state_count():
    a = _np32(make_inputs(1, 8, 1, 2, 16, 16, seed=12, seqlens=[3, 5]))
    with pytest.raises(ValueError, match="initial_state"):
        flashqla.gdn_chunk(a["q"], a["k"], a["v"], a["g"], a["beta"], cu_seqlens=[0, 8],
                           initial_state=a["h0"])


@torch_only
def test_mixed_frameworks_raise():
    import torch
    a = _bad_base()
    with pytest.raises(TypeError, match="k"):
        flashqla.gdn_chunk(torch.from_numpy(a["q"]), a["k"], a["v"], a["g"], a["beta"])


def test_bad_backward_inputs_raise():
    a = _bad_base()
    _, _, ctx = flashqla.gdn_chunk_fwd(a["q"], a["k"], a["v"], a["g"], a["beta"])
    with pytest.raises(TypeError, match="ctx"):
        flashqla.gdn_chunk_bwd(object(), a["v"])
    with pytest.raises(ValueError, match="do"):
        flashqla.gdn_chunk_bwd(ctx, a["v"][:, :5].copy())
    with pytest.raises(ValueError, match="dfinal_state"):
        flashqla.gdn_chunk_bwd(ctx, a["v"], np.zeros((3, 4, 16, 16), np.float32))


def test_bad_recurrent_inputs_raise_and_leave_state_untouched():
    a = _np32(make_inputs(2, 1, 1, 2, 16, 16, seed=13, h0=False))
    args = [a[n] for n in ("q", "k", "v", "g", "beta")]
    pool = np.random.default_rng(0).standard_normal((3, 2, 16, 16)).astype(np.float32)
    before = pool.copy()
    ro = pool.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="state"):
        flashqla.gdn_recurrent(*args, ro, state_indices=[0, 1])
    with pytest.raises(TypeError, match="state"):
        flashqla.gdn_recurrent(*args, pool.astype(np.float16), state_indices=[0, 1])
    with pytest.raises(ValueError, match="state"):   # not contiguous: cannot update in place
        flashqla.gdn_recurrent(*args, np.asfortranarray(pool), state_indices=[0, 1])
    with pytest.raises(ValueError, match="state_indices"):
        flashqla.gdn_recurrent(*args, pool, state_indices=[0, 3])
    with pytest.raises(ValueError, match="state_indices"):
        flashqla.gdn_recurrent(*args, pool, state_indices=[0, 1, 2])
    with pytest.raises(ValueError, match="state"):   # P != N without indices
        flashqla.gdn_recurrent(*args, pool)
    with pytest.raises(ValueError, match="state"):
        flashqla.gdn_recurrent(*args, pool[:, :1].copy(), state_indices=[0, 1])
    np.testing.assert_array_equal(pool, before)


# ------------------------------------------------------------------ misc ----

def test_error_is_exported():
    assert flashqla.Error is flashqla._C.Error
    assert issubclass(flashqla.Error, Exception)


def test_import_needs_no_framework():
    code = ("import sys, flashqla; "
            "bad = [m for m in ('torch', 'jax', 'cupy') if m in sys.modules]; "
            "assert not bad, bad; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_reference_helper_converts_everything():
    assert to_f64([1, 2]).dtype == np.float64
