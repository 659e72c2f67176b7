"""PyTorch operators (flashqla/_torch.py): torch.ops.flashqla.chunk_fwd /
chunk_bwd / recurrent with fake kernels and autograd; torch.compile with
fullgraph=True (gradients included), torch.library.opcheck, torch.func.grad,
the eager fast path of the recurrent step, and on the GPU the same plus CUDA
graph capture. Every result is checked against the float64 reference."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashqla  # noqa: E402
import flashqla._torch  # noqa: E402,F401  (registers torch.ops.flashqla.*)
from flashqla import reference  # noqa: E402
from gdn_testing import (GRAD_NAMES, assert_close, cast_inputs_torch, make_inputs,  # noqa: E402
                         reference_of, to_f64, tolerance)

TOL32 = tolerance("float32", "o")
LEAVES = ("q", "k", "v", "g", "beta", "h0")
# torch.ops.flashqla.recurrent's arguments after use_qk_l2norm for a plain step
# (intermediate_states, update_state, state_layout, A_log, dt_bias, the two
# in-kernel gate flags): the op has no defaults (see its docstring)
RECURRENT_PLAIN = (None, True, "kv", None, None, False, False)


def _loss_fn(t, fn=None, **kw):
    fn = fn or flashqla.gdn_chunk

    def loss(q, k, v, g, beta, h0):
        o, ht = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                   cu_seqlens=t["cu_seqlens"], **kw)
        return (o.float() * t["do"].float()).sum() + (ht * t["dht"]).sum()
    return loss


def _check_grads(leaves, ref, dtype="float32"):
    for name, leaf in zip(GRAD_NAMES, leaves):
        assert leaf.grad is not None, name
        assert leaf.grad.dtype == leaf.dtype
        assert_close(name, leaf.grad, ref[name], tolerance(dtype, name))


def _leaves(t):
    return [t[n].clone().requires_grad_() for n in LEAVES]


# --------------------------------------------------------- torch.compile ----

def test_compile_fullgraph_gdn_chunk_with_gradients():
    """The default backend (inductor): forward and backward in one graph each."""
    torch._dynamo.reset()
    inp = make_inputs(1, 100, 2, 4, 16, 16, seed=1, seqlens=[30, 70], dht=True)
    t = cast_inputs_torch(inp, "float32")
    compiled = torch.compile(_loss_fn(t), fullgraph=True)
    leaves = _leaves(t)
    compiled(*leaves).backward()
    _check_grads(leaves, reference_of(t))
    # a second call with new values reuses the graph and is right again
    inp2 = make_inputs(1, 100, 2, 4, 16, 16, seed=2, seqlens=[30, 70], dht=True)
    t2 = cast_inputs_torch(inp2, "float32")
    leaves2 = _leaves(dict(t, **{n: t2[n] for n in LEAVES}))
    compiled(*leaves2).backward()
    _check_grads(leaves2, reference_of(dict(t2, do=t["do"], dht=t["dht"])))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_compile_fullgraph_chunk_gated_delta_rule(dtype):
    """FLA's signature, l2norm inside, bf16 inputs with float32 gates."""
    torch._dynamo.reset()
    inp = make_inputs(1, 90, 2, 4, 32, 32, seed=3, seqlens=[45, 45], dht=True,
                      normalize_qk=False)
    t = cast_inputs_torch(inp, dtype)

    def loss(q, k, v, g, beta, h0):
        o, ht = flashqla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                output_final_state=True,
                                                use_qk_l2norm_in_kernel=True,
                                                cu_seqlens=t["cu_seqlens"], head_first=False)
        return (o.float() * t["do"].float()).sum() + (ht * t["dht"]).sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    leaves = _leaves(t)
    compiled(*leaves).backward()
    _check_grads(leaves, reference_of(t, use_qk_l2norm=True), dtype)


def test_compile_fullgraph_only_final_state_and_no_initial_state():
    torch._dynamo.reset()
    inp = make_inputs(2, 70, 1, 2, 16, 16, seed=4, h0=False, dht=True)
    t = cast_inputs_torch(inp, "float32")

    def loss(q, k):
        _, ht = flashqla.gdn_chunk(q, k, t["v"], t["g"], t["beta"], output_final_state=True)
        return (ht * t["dht"]).sum()

    q, k = t["q"].clone().requires_grad_(), t["k"].clone().requires_grad_()
    torch.compile(loss, fullgraph=True, backend="aot_eager")(q, k).backward()
    ref = reference_of(dict(t, do=np.zeros(inp["do"].shape)))
    assert_close("dq", q.grad, ref["dq"], TOL32)
    assert_close("dk", k.grad, ref["dk"], TOL32)


def test_compile_fullgraph_gdn_recurrent_updates_the_pool():
    torch._dynamo.reset()
    inp = make_inputs(3, 2, 1, 2, 16, 16, seed=5, h0=False)
    t = cast_inputs_torch(inp, "float32")
    pool = torch.randn(4, 2, 16, 16)
    before = pool.clone()
    idx = torch.tensor([2, -1, 0], dtype=torch.int32)

    def step(q, k, v, g, beta, pool):
        return flashqla.gdn_recurrent(q, k, v, g, beta, pool, state_indices=idx) * 2.0

    o = torch.compile(step, fullgraph=True)(t["q"], t["k"], t["v"], t["g"], t["beta"], pool)
    o_ref, pool_ref = reference.recurrent(*(inp[n] for n in ("q", "k", "v", "g", "beta")),
                                          before.numpy(), state_indices=[2, -1, 0])
    assert_close("o", o, 2.0 * o_ref, TOL32)
    assert_close("pool", pool, pool_ref, TOL32)
    assert torch.equal(pool[1], before[1]) and torch.equal(pool[3], before[3])


# ------------------------------------------------------------- opcheck ----

def _op_args(t, h0=True, cu=True, grad=False):
    x = {n: t[n] for n in LEAVES}
    if grad:
        x = {n: v.clone().requires_grad_() for n, v in x.items() if v is not None}
    h0_ = None
    if h0:  # one state per sequence: N = len(cu_seqlens) - 1, or B without cu_seqlens
        h0_ = x["h0"] if cu else x["h0"][:t["q"].shape[0]].detach().clone().requires_grad_(grad)
    return (x["q"], x["k"], x["v"], x["g"], x["beta"], h0_, t["cu_seqlens"] if cu else None)


@pytest.mark.parametrize("h0,cu,final", [(True, True, True), (False, False, False),
                                          (True, False, False)])
def test_opcheck_chunk_fwd_and_bwd(h0, cu, final):
    inp = make_inputs(1, 40, 1, 2, 16, 16, seed=6, seqlens=[15, 25], dht=True)
    t = cast_inputs_torch(inp, "float32")
    for grad in (False, True):
        torch.library.opcheck(torch.ops.flashqla.chunk_fwd.default,
                              _op_args(t, h0, cu, grad) + (0.25, final, False))
    q, k, v, g, beta, h0_, cu_ = _op_args(t, h0, cu)
    dht = None if not final else t["dht"] if cu else t["dht"][:1].contiguous()
    torch.library.opcheck(torch.ops.flashqla.chunk_bwd.default,
                          (q, k, v, g, beta, h0_, cu_, t["do"], dht, 0.25, True))


@pytest.mark.parametrize("with_idx", [False, True])
def test_opcheck_recurrent(with_idx):
    inp = make_inputs(3, 2, 1, 2, 16, 16, seed=7, h0=False)
    t = cast_inputs_torch(inp, "float32")
    pool = torch.randn(5 if with_idx else 3, 2, 16, 16)
    idx = torch.tensor([4, -1, 0], dtype=torch.int64) if with_idx else None
    torch.library.opcheck(torch.ops.flashqla.recurrent.default,
                          (t["q"], t["k"], t["v"], t["g"], t["beta"], pool, idx, None, 0.25,
                           False) + RECURRENT_PLAIN)


def test_ops_directly_with_autograd():
    """torch.ops.flashqla.chunk_fwd carries its own autograd formula."""
    inp = make_inputs(1, 50, 1, 2, 16, 16, seed=8, dht=True)
    t = cast_inputs_torch(inp, "float32")
    leaves = _leaves(t)
    o, ht = torch.ops.flashqla.chunk_fwd(*leaves, None, 16 ** -0.5, True, False)
    ((o * t["do"]).sum() + (ht * t["dht"]).sum()).backward()
    _check_grads(leaves, reference_of(t))
    o, empty = torch.ops.flashqla.chunk_fwd(*leaves, None, 16 ** -0.5, False, False)
    assert empty.shape == (0,) and empty.dtype == torch.float32


# ----------------------------------------------------------- torch.func ----

def test_torch_func_grad():
    inp = make_inputs(1, 60, 1, 2, 16, 16, seed=9, seqlens=[20, 40], dht=True)
    t = cast_inputs_torch(inp, "float32")
    grads = torch.func.grad(_loss_fn(t), argnums=tuple(range(6)))(*(t[n] for n in LEAVES))
    ref = reference_of(t)
    for name, grad in zip(GRAD_NAMES, grads):
        assert_close(name, grad, ref[name], TOL32)


def test_torch_func_grad_and_value_under_compile():
    torch._dynamo.reset()
    inp = make_inputs(1, 40, 1, 2, 16, 16, seed=10)
    t = cast_inputs_torch(inp, "float32")

    def loss(q):
        return (flashqla.gdn_chunk(q, t["k"], t["v"], t["g"], t["beta"],
                                   initial_state=t["h0"])[0] * t["do"]).sum()

    dq, value = torch.compile(torch.func.grad_and_value(loss), fullgraph=True,
                              backend="aot_eager")(t["q"])
    ref = reference_of(t)
    assert_close("dq", dq, ref["dq"], TOL32)
    assert abs(float(value) - float((ref["o"] * inp["do"]).sum())) <= 1e-4 * abs(float(value))


# ------------------------------------------------ the recurrent fast path ----

class _Recorder(torch.overrides.TorchFunctionMode):
    """A function mode that lets everything through (and so turns the fast path off)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_recurrent_fast_path_equals_the_op():
    inp = make_inputs(4, 3, 2, 4, 32, 32, seed=11, h0=False)
    t = cast_inputs_torch(inp, "bfloat16")
    pool = torch.randn(6, 4, 32, 32)
    idx = torch.tensor([5, 0, -1, 2], dtype=torch.int32)
    args = (t["q"], t["k"], t["v"], t["g"], t["beta"])
    assert flashqla._torch._plain_eager(*args, pool, idx)
    pool_fast, pool_op = pool.clone(), pool.clone()
    o_fast = flashqla.gdn_recurrent(*args, pool_fast, state_indices=idx)
    with _Recorder():
        assert not flashqla._torch._plain_eager(*args, pool_op, idx)
        o_op = flashqla.gdn_recurrent(*args, pool_op, state_indices=idx)
    assert torch.equal(o_fast, o_op) and torch.equal(pool_fast, pool_op)
    o_ref, pool_ref = reference.recurrent(*(to_f64(x) for x in args), pool.numpy(),
                                          state_indices=idx.numpy())
    assert_close("o", o_fast, o_ref, tolerance("bfloat16", "o"))
    assert_close("pool", pool_fast, pool_ref, tolerance("bfloat16", "ht"))


def _no_full_path(*args, **kwargs):
    raise AssertionError("the fast path was expected, not recurrent_prepared")


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("update", [True, False])
def test_recurrent_fast_path_verify_and_layouts_equal_the_op(monkeypatch, layout, update):
    """intermediate_states, update_state=False and state_layout="vk" take the
    fast path too (K != V, so the layout decides the pool's shape) and give
    the op's bits; update_state=False leaves the pool as it was."""
    N, T, HV, K, V = 3, 4, 4, 32, 16
    inp = make_inputs(N, T, 2, HV, K, V, seed=15, h0=False)
    t = cast_inputs_torch(inp, "float32")
    sd = (K, V) if layout == "kv" else (V, K)
    pool = torch.randn((5, HV) + sd)
    inter = torch.full((N, T, HV) + sd, float("nan"))
    idx = torch.tensor([4, -1, 1], dtype=torch.int32)
    args = (t["q"], t["k"], t["v"], t["g"], t["beta"])
    out = []
    for fast in (True, False):
        p, i = pool.clone(), inter.clone()
        kw = dict(state_indices=idx, intermediate_states=i, update_state=update, state_layout=layout)
        if fast:
            with monkeypatch.context() as m:
                m.setattr(flashqla._torch, "recurrent_prepared", _no_full_path)
                o = flashqla.gdn_recurrent(*args, p, **kw)
        else:
            with _Recorder():
                o = flashqla.gdn_recurrent(*args, p, **kw)
        out.append((o, p, i))
    (o1, p1, i1), (o2, p2, i2) = out
    assert torch.equal(o1, o2) and torch.equal(p1, p2)
    torch.testing.assert_close(i1, i2, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(i1[1]).all()  # the padding sequence's rows are left as they were
    if not update:
        assert torch.equal(p1, pool)
    pool_kv = pool if layout == "kv" else pool.transpose(-1, -2)
    o_ref, _ = reference.recurrent(*(to_f64(x) for x in args), pool_kv.numpy(),
                                   state_indices=idx.numpy())
    assert_close("o", o1, o_ref, TOL32)


@pytest.mark.parametrize("scale", [None, 32 ** -0.5, 0.3, np.float32(0.3), 1])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_recurrent_fast_path_scale_and_strided_inputs_equal_the_op(scale, strided, dtype):
    """The hot path hands scale None or a float to the binding as it came (None:
    K ** -0.5 there, the same double as Python's) and other types through
    scale_of; a non-contiguous q or v, which the binding refuses, sends the
    call down the full path. Every variant gives the op's bits, and scale None
    the bits of scale = K ** -0.5 (float64: the scale's double itself)."""
    inp = make_inputs(3, 1, 2, 4, 32, 32, seed=17, h0=False)
    t = cast_inputs_torch(inp, dtype)
    q, v = t["q"], t["v"]
    if strided:  # the same values, every other element of a wider tensor
        q = torch.stack([q, torch.zeros_like(q)], dim=-1).flatten(-2)[..., ::2]
        v = torch.stack([v, torch.zeros_like(v)], dim=-1).flatten(-2)[..., ::2]
        assert not q.is_contiguous() and not v.is_contiguous()
        assert torch.equal(q, t["q"]) and torch.equal(v, t["v"])
    pool = torch.randn(4, 4, 32, 32, dtype=torch.float64 if dtype == "float64" else torch.float32)
    idx = torch.tensor([3, 0, 1], dtype=torch.int32)
    args = (q, t["k"], v, t["g"], t["beta"])
    out = []
    for mode in ("fast", "op") + (("explicit",) if scale is None else ()):
        p = pool.clone()
        sc = 32 ** -0.5 if mode == "explicit" else scale
        if mode == "op":
            with _Recorder():
                o = flashqla.gdn_recurrent(*args, p, state_indices=idx, scale=sc)
        else:
            o = flashqla.gdn_recurrent(*args, p, state_indices=idx, scale=sc)
        out.append((o, p))
    for o, p in out[1:]:
        assert torch.equal(out[0][0], o) and torch.equal(out[0][1], p)
    o_ref, _ = reference.recurrent(*(to_f64(x) for x in args), pool.numpy(), state_indices=idx.numpy(),
                                   scale=None if scale is None else float(scale))
    assert_close("o", out[0][0], o_ref, tolerance(dtype, "o"))


def _no_capsule(x):
    raise AssertionError("the exchange API was expected, not a to_dlpack capsule")


@pytest.mark.parametrize("verify", [False, True])
def test_recurrent_fast_path_exchange_api_and_capsules_give_the_same_bits(monkeypatch, verify):
    """The hot path and the op's kernel hand the tensors themselves to the
    binding (taken there through torch's DLPack C exchange API: no capsule
    made) where torch has that API, capsules where it has not (the op:
    recurrent_prepared): the same bits every way, the hot path in C
    (_C.recurrent_hot) and in Python (recurrent_hot) alike."""
    N, T, HV = 3, (4 if verify else 1), 4
    t = cast_inputs_torch(make_inputs(N, T, 2, HV, 32, 32, seed=23, h0=False), "float32")
    args = (t["q"], t["k"], t["v"], t["g"], t["beta"])
    pool = torch.randn(5, HV, 32, 32)
    idx = torch.tensor([4, -1, 1], dtype=torch.int32)
    out = []
    for mode in ("exchange", "exchange-python", "capsules", "op", "op-prepared"):
        p = pool.clone()
        i = torch.zeros((N, T, HV, 32, 32)) if verify else None
        kw = dict(state_indices=idx, intermediate_states=i, update_state=not verify)
        with monkeypatch.context() as m:
            if mode.startswith("op"):
                if mode == "op-prepared":
                    m.setattr(flashqla._torch, "_EXCHANGE", False)
                elif flashqla._torch._EXCHANGE:
                    m.setattr(flashqla._torch, "recurrent_prepared", _no_full_path)
                with _Recorder():
                    o = flashqla.gdn_recurrent(*args, p, **kw)
            else:
                m.setattr(flashqla._torch, "recurrent_prepared", _no_full_path)
                if mode != "exchange":  # the hot path in Python
                    m.setattr(flashqla._api, "_recurrent_hot", flashqla._torch.recurrent_hot)
                if mode.startswith("exchange"):
                    if not flashqla._torch._EXCHANGE:
                        continue  # this torch has no exchange API: capsules only
                    m.setattr(flashqla._torch, "_to_dlpack", _no_capsule)
                else:
                    m.setattr(flashqla._torch, "_EXCHANGE", False)
                o = flashqla.gdn_recurrent(*args, p, **kw)
        out.append((o, p, i))
    assert flashqla._torch._EXCHANGE == flashqla._C.exchange_api(torch.Tensor)
    for o, p, i in out[1:]:
        assert torch.equal(out[0][0], o) and torch.equal(out[0][1], p)
        assert i is None or torch.equal(out[0][2], i)


@pytest.mark.parametrize("path", ["hot", "hot-python", "checked", "op"])
@pytest.mark.parametrize("verify", [False, True])
def test_recurrent_and_commit_bump_the_version_of_what_they_write(monkeypatch, path, verify):
    """Every path bumps the autograd version counter of the pool it updates
    (the eager paths not with update_state=False) and of intermediate_states,
    as the op's ADInplaceOrView kernel does, and so does gdn_commit: a backward through a
    saved copy of them raises instead of using the new values silently."""
    N, T, HV = 2, (3 if verify else 1), 2
    t = cast_inputs_torch(make_inputs(N, T, 1, HV, 16, 16, seed=29, h0=False), "float32")
    q = t["q"].clone().requires_grad_() if path == "checked" else t["q"]  # the hot path refuses it
    args = (q, t["k"], t["v"], t["g"], t["beta"])
    pool = torch.randn(N, HV, 16, 16)
    inter = torch.zeros(N, T, HV, 16, 16) if verify else None
    w = torch.randn(N, HV, 16, 16, requires_grad=True)
    saved = [(pool * w).sum()] + ([(inter[:, 0] * w).sum()] if verify else [])
    versions = pool._version, (inter._version if verify else None)
    kw = dict(intermediate_states=inter, update_state=not verify)
    if path == "hot-python":
        monkeypatch.setattr(flashqla._api, "_recurrent_hot", flashqla._torch.recurrent_hot)
    if path == "op":
        with _Recorder():
            flashqla.gdn_recurrent(*args, pool, **kw)
    else:
        flashqla.gdn_recurrent(*args, pool, **kw)
    # (the op's schema marks the pool mutable, so the op bumps it with update_state=False too)
    assert (pool._version > versions[0]) is (not verify or path == "op")
    if verify:
        assert inter._version > versions[1]
        if path != "op":
            saved[0].backward()  # the pool was not written: its saved copy is still good
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            saved[1].backward()
        y = (pool * w).sum()
        before = pool._version
        if path == "op":
            with _Recorder():
                flashqla.gdn_commit(pool, inter, None, torch.tensor([1, 2]))
        else:
            flashqla.gdn_commit(pool, inter, None, torch.tensor([1, 2]))
        assert pool._version > before
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()
    else:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            saved[0].backward()


@pytest.mark.skipif(not flashqla._torch._EXCHANGE, reason="this torch has no DLPack C exchange API")
def test_c_hot_path_takes_what_the_python_one_takes_and_refuses_the_rest():
    """_C.recurrent_hot makes recurrent_hot's decisions: the calls it takes give
    the bits of the Python hot path (o, the pool, intermediate_states, the
    version bumps); every call the Python one refuses (a subclass, requires_grad,
    a gate dtype, indices that are not a tensor or on another device, a layout or
    update_state it does not know, a grad-requiring intermediate_states, an active
    TorchFunctionMode, a non-contiguous q) it refuses too (None, nothing written),
    and a scale that is not a float (which the Python one converts) goes to the
    checked path; no reference is leaked or lost."""
    import sys
    hot, py = flashqla._C.recurrent_hot, flashqla._torch.recurrent_hot
    N, T, HV = 3, 2, 4
    t = cast_inputs_torch(make_inputs(N, T, 2, HV, 16, 16, seed=31, h0=False), "float32")
    q, k, v, g, beta = t["q"], t["k"], t["v"], t["g"], t["beta"]
    pool = torch.randn(5, HV, 16, 16)
    idx = torch.tensor([4, -1, 1], dtype=torch.int32)
    inter = torch.zeros(N, T, HV, 16, 16)

    def both(*a):
        """(the C result, the Python result), each on its own copy of the pool and
        intermediate_states; the versions each bumped"""
        res = []
        for f in (hot, py):
            p = pool.clone()
            i = a[3].clone() if a[3] is not None else None
            vp, vi = p._version, (i._version if i is not None else None)
            o = f(a[0], k, v, g, beta, p, idx, a[1], a[2], i, a[4], a[5])
            res.append((o, p, i, p._version - vp, None if i is None else i._version - vi))
        return res

    for a in [(q, None, False, None, True, "kv"), (q, 0.25, True, None, True, "kv"),
              (q, None, False, inter, False, "kv"), (q, None, False, inter, True, "vk"),
              (q, None, False, None, False, "kv")]:
        (oc, pc, ic, dpc, dic), (op, pp, ip, dpp, dip) = both(*a)
        assert oc is not None and op is not None
        assert torch.equal(oc, op) and torch.equal(pc, pp) and (ic is None or torch.equal(ic, ip))
        assert (dpc, dic) == (dpp, dip)
        assert (dpc > 0) is (a[4] is True) and (dic is None or dic > 0)

    class Sub(torch.Tensor):
        pass

    refused = [
        dict(q=q.as_subclass(Sub)), dict(q=q.clone().requires_grad_()), dict(g=g.double()),
        dict(beta=beta.half()), dict(idx=[4, -1, 1]), dict(idx=idx.numpy()),
        dict(layout="KV"), dict(layout=None), dict(update=1), dict(scale=1),
        dict(scale=np.float32(0.3)), dict(inter=inter.clone().requires_grad_()),
        dict(q=torch.stack([q, q], -1)[..., 0]),
    ]
    if torch.cuda.is_available():
        refused.append(dict(idx=idx.cuda()))
    for r in refused:
        a = dict(q=q, g=g, beta=beta, idx=idx, scale=None, inter=None, update=True, layout="kv")
        a.update(r)
        p = pool.clone()
        before = p.clone()
        got = hot(a["q"], k, v, a["g"], a["beta"], p, a["idx"], a["scale"], False, a["inter"], a["update"],
                  a["layout"])
        assert got is None, r
        assert torch.equal(p, before)
        # (the Python one takes a strided q to the binding, which refuses it, and converts
        # a scale that is not a float, scale_of: both end as the checked path's result)
        if ("q" not in r or r["q"].is_contiguous()) and "scale" not in r:
            assert py(a["q"], k, v, a["g"], a["beta"], p, a["idx"], a["scale"], False, a["inter"], a["update"],
                      a["layout"]) is None, r
    with _Recorder():
        assert hot(q, k, v, g, beta, pool.clone(), idx, None, False, None, True, "kv") is None
    with pytest.raises(TypeError, match="12 positional"):
        hot(q, k, v)
    objs = (q, k, v, g, beta, pool, idx, inter)
    counts = [sys.getrefcount(x) for x in objs]
    for _ in range(200):
        hot(q, k, v, g, beta, pool, idx, None, False, None, True, "kv")
        hot(q, k, v, g, beta, pool, idx, None, False, inter, False, "kv")
        hot(q.clone().requires_grad_(), k, v, g, beta, pool, idx, None, False, None, True, "kv")
        hot(q, k, v, g, beta, pool, idx, None, False, None, True, "bad")
    assert [sys.getrefcount(x) for x in objs] == counts


def test_commit_fast_path_equals_the_op_and_falls_back():
    """gdn_commit's hot path (plain tensors straight to the binding) gives the
    op's bits; lists, a bad layout, num_accepted None and an out-of-range
    count take the checked path and its errors, writing nothing."""
    P, N, Ti, HV = 5, 3, 4, 2
    pool = torch.randn(P, HV, 16, 8)
    inter = torch.randn(N, Ti, HV, 16, 8)
    idx = torch.tensor([4, -1, 1], dtype=torch.int32)
    acc = torch.tensor([2, 3, 0], dtype=torch.int64)
    fast, op = pool.clone(), pool.clone()
    flashqla.gdn_commit(pool.clone(), inter, idx, acc)  # the first torch call brings the hot path in
    with pytest.MonkeyPatch.context() as m:
        if flashqla._torch._EXCHANGE:
            m.setattr(flashqla._torch, "commit_prepared", _no_full_path)
        flashqla.gdn_commit(fast, inter, idx, acc)
    with _Recorder():
        flashqla.gdn_commit(op, inter, idx, acc)
    assert torch.equal(fast, op)
    assert torch.equal(fast[4], inter[0, 1]) and torch.equal(fast[1], pool[1])
    lists = pool.clone()
    flashqla.gdn_commit(lists, inter, [4, -1, 1], [2, 3, 0])
    assert torch.equal(lists, op)
    vk = pool.transpose(-1, -2).contiguous()
    flashqla.gdn_commit(vk, inter.transpose(-1, -2).contiguous(), idx, acc, state_layout="vk")
    assert torch.equal(vk.transpose(-1, -2), op)
    before = pool.clone()
    with pytest.raises(ValueError, match=r"^state_layout: expected"):
        flashqla.gdn_commit(pool, inter, idx, acc, state_layout="kvx")
    with pytest.raises(TypeError, match=r"^num_accepted: expected an array .*, got None"):
        flashqla.gdn_commit(pool, inter, idx, None)
    with pytest.raises(ValueError, match=r"num_accepted"):
        flashqla.gdn_commit(pool, inter, idx, torch.tensor([2, 9, 0]))
    assert torch.equal(pool, before)


def test_recurrent_fast_path_rejected_verify_leaves_the_buffers():
    """A verify call the binding rejects (intermediate_states of the wrong
    layout) raises ValueError naming it and writes nothing."""
    inp = make_inputs(2, 2, 1, 2, 32, 16, seed=16, h0=False)
    t = cast_inputs_torch(inp, "float32")
    pool = torch.randn(2, 2, 32, 16)
    inter = torch.full((2, 2, 2, 16, 32), 7.0)         # [.., V, K] with the "kv" pool
    pool0, inter0 = pool.clone(), inter.clone()
    with pytest.raises(ValueError, match=r"^intermediate_states: expected shape"):
        flashqla.gdn_recurrent(t["q"], t["k"], t["v"], t["g"], t["beta"], pool,
                               intermediate_states=inter, update_state=False)
    assert torch.equal(pool, pool0) and torch.equal(inter, inter0)


def test_recurrent_inputs_that_require_grad_give_a_plain_output():
    inp = make_inputs(2, 1, 1, 2, 16, 16, seed=12, h0=False)
    t = cast_inputs_torch(inp, "float32")
    q = t["q"].clone().requires_grad_()
    o = flashqla.gdn_recurrent(q, t["k"], t["v"], t["g"], t["beta"], torch.zeros(2, 2, 16, 16))
    assert not o.requires_grad


# ---------------------------------------------------------------- GPU ----

def _cuda(t):
    return {n: (None if x is None else x.cuda()) for n, x in t.items()}


@pytest.mark.gpu
def test_cuda_compile_fullgraph_with_gradients():
    torch._dynamo.reset()
    inp = make_inputs(1, 300, 2, 4, 128, 128, seed=13, seqlens=[100, 200], dht=True)
    t = _cuda(cast_inputs_torch(inp, "bfloat16"))
    compiled = torch.compile(_loss_fn(t), fullgraph=True)
    leaves = _leaves(t)
    compiled(*leaves).backward()
    _check_grads(leaves, reference_of(t), "bfloat16")


@pytest.mark.gpu
def test_cuda_opcheck():
    inp = make_inputs(1, 130, 1, 2, 64, 64, seed=14, seqlens=[65, 65], dht=True)
    t = _cuda(cast_inputs_torch(inp, "bfloat16"))
    for grad in (False, True):
        torch.library.opcheck(torch.ops.flashqla.chunk_fwd.default,
                              _op_args(t, grad=grad) + (0.125, True, False))
    q, k, v, g, beta, h0, cu = _op_args(t)
    torch.library.opcheck(torch.ops.flashqla.chunk_bwd.default,
                          (q, k, v, g, beta, h0, cu, t["do"], t["dht"], 0.125, False))
    pool = torch.randn(3, 2, 64, 64, device="cuda")
    torch.library.opcheck(torch.ops.flashqla.recurrent.default,
                          (q[:, :2].contiguous(), k[:, :2].contiguous(), v[:, :2].contiguous(),
                           g[:, :2].contiguous(), beta[:, :2].contiguous(), pool,
                           torch.tensor([2], device="cuda"), None, 0.125, False) + RECURRENT_PLAIN)


@pytest.mark.gpu
def test_cuda_func_grad_and_compiled_recurrent():
    inp = make_inputs(1, 200, 2, 4, 128, 128, seed=15, dht=True)
    t = _cuda(cast_inputs_torch(inp, "bfloat16"))
    grads = torch.func.grad(_loss_fn(t), argnums=(0, 2))(t["q"], t["k"], t["v"], t["g"],
                                                         t["beta"], t["h0"])
    ref = reference_of(t)
    assert_close("dq", grads[0], ref["dq"], tolerance("bfloat16", "dq"))
    assert_close("dv", grads[1], ref["dv"], tolerance("bfloat16", "dv"))
    torch._dynamo.reset()
    dec = make_inputs(4, 1, 2, 4, 128, 128, seed=16, h0=False)
    d = _cuda(cast_inputs_torch(dec, "bfloat16"))
    pool = torch.randn(5, 4, 128, 128, device="cuda")
    before = pool.cpu().numpy()
    idx = torch.tensor([4, -1, 0, 1], device="cuda", dtype=torch.int32)
    step = torch.compile(lambda *a: flashqla.gdn_recurrent(*a, pool, state_indices=idx),
                         fullgraph=True)
    o = step(d["q"], d["k"], d["v"], d["g"], d["beta"])
    o_ref, pool_ref = reference.recurrent(*(to_f64(d[n]) for n in ("q", "k", "v", "g", "beta")),
                                          before, state_indices=[4, -1, 0, 1])
    assert_close("o", o, o_ref, tolerance("bfloat16", "o"))
    assert_close("pool", pool, pool_ref, tolerance("bfloat16", "ht"))


@pytest.mark.gpu
def test_cuda_graph_capture_of_the_torch_ops():
    """gdn_chunk with autograd (chunk_fwd + chunk_bwd ops) and gdn_recurrent
    (the recurrent op, and its eager fast path) captured in CUDA graphs."""
    inp = make_inputs(1, 500, 2, 4, 128, 128, seed=17, dht=True)
    t = _cuda(cast_inputs_torch(inp, "bfloat16"))
    static = {n: t[n].clone() for n in LEAVES + ("do", "dht")}
    leaves = [static[n].requires_grad_() for n in LEAVES]

    def train_step():
        for x in leaves:
            x.grad = None
        o, ht = flashqla.gdn_chunk(*leaves[:5], initial_state=leaves[5], output_final_state=True)
        torch.autograd.backward([o, ht], [static["do"], static["dht"]])
        return [o.detach(), ht.detach()] + [x.grad for x in leaves]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            train_step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = train_step()
    for x in outs:
        x.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = reference_of(t)
    names = ("o", "ht") + GRAD_NAMES
    for name, got in zip(names, outs):
        assert_close(f"{name} (graph replay)", got, ref[name], tolerance("bfloat16", name))

    dec = make_inputs(3, 1, 2, 4, 128, 128, seed=18, h0=False)
    d = _cuda(cast_inputs_torch(dec, "bfloat16"))
    pool = torch.randn(4, 4, 128, 128, device="cuda")
    start = pool.clone()
    idx = torch.tensor([3, 0, -1], device="cuda", dtype=torch.int32)
    args = [d[n] for n in ("q", "k", "v", "g", "beta")]
    for use_op in (False, True):
        pool.copy_(start)
        with torch.cuda.stream(side):
            flashqla.gdn_recurrent(*args, pool, state_indices=idx)  # warm-up
        torch.cuda.current_stream().wait_stream(side)
        pool.copy_(start)
        g2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g2):
            if use_op:
                o = torch.ops.flashqla.recurrent(*args, pool, idx, None, 128 ** -0.5, False,
                                                 *RECURRENT_PLAIN)
            else:
                o = flashqla.gdn_recurrent(*args, pool, state_indices=idx)
        pool.copy_(start)
        g2.replay()
        torch.cuda.synchronize()
        o_ref, pool_ref = reference.recurrent(*(to_f64(x) for x in args), start.cpu().numpy(),
                                              state_indices=[3, 0, -1])
        assert_close(f"o (op={use_op})", o, o_ref, tolerance("bfloat16", "o"))
        assert_close(f"pool (op={use_op})", pool, pool_ref, tolerance("bfloat16", "ht"))


@pytest.mark.gpu
@pytest.mark.parametrize("verify", [False, True])
def test_cuda_recurrent_fast_path_launches_on_the_current_stream(monkeypatch, verify):
    """The eager fast path on CUDA (torch's current stream as a raw int, no
    workspace), decode and verify, on a side stream kept busy: its kernel
    waits for the pool copy queued before it there (on any other stream it
    would read the NaN pool), and its bits equal the op's."""
    N, T, HV = 4, (4 if verify else 1), 4
    dec = make_inputs(N, T, 2, HV, 128, 128, seed=19, h0=False)
    d = _cuda(cast_inputs_torch(dec, "bfloat16"))
    args = [d[n] for n in ("q", "k", "v", "g", "beta")]
    start = torch.randn(5, HV, 128, 128, device="cuda")
    idx = torch.tensor([4, -1, 0, 2], device="cuda", dtype=torch.int32)

    def inter():
        return torch.zeros((N, T, HV, 128, 128), device="cuda") if verify else None

    pool, inter_fast = torch.full_like(start, float("nan")), inter()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with monkeypatch.context() as m:
        m.setattr(flashqla._torch, "recurrent_prepared", _no_full_path)
        with torch.cuda.stream(side):
            torch.cuda._sleep(100_000_000)                 # tens of ms queued first
            pool.copy_(start)
            o_fast = flashqla.gdn_recurrent(*args, pool, state_indices=idx,
                                            intermediate_states=inter_fast, update_state=not verify)
    torch.cuda.synchronize()
    pool_op, inter_op = start.clone(), inter()
    with _Recorder():
        o_op = flashqla.gdn_recurrent(*args, pool_op, state_indices=idx,
                                      intermediate_states=inter_op, update_state=not verify)
    torch.cuda.synchronize()
    assert torch.equal(o_fast, o_op) and torch.equal(pool, pool_op)
    if verify:
        assert torch.equal(inter_fast, inter_op) and torch.equal(pool, start)
    o_ref, _ = reference.recurrent(*(to_f64(x) for x in args), start.cpu().numpy(),
                                   state_indices=[4, -1, 0, 2])
    assert_close("o", o_fast, o_ref, tolerance("bfloat16", "o"))


# ---------------------------------------------------------- torch.func.vmap ----

def _stacked(n, seed, **kw):
    ins = [cast_inputs_torch(make_inputs(2, 40, 1, 2, 16, 16, seed=seed + i, dht=True, **kw),
                             "float32") for i in range(n)]
    return ins, {name: torch.stack([t[name] for t in ins])
                 for name in LEAVES + ("do", "dht")}


def _fwd(q, k, v, g, beta, h0):
    return flashqla.gdn_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True)


def test_torch_func_vmap_forward_folds_into_the_batch():
    ins, s = _stacked(3, 20)
    o, ht = torch.func.vmap(_fwd)(*(s[n] for n in LEAVES))
    assert o.shape == (3, 2, 40, 2, 16) and ht.shape == (3, 2, 2, 16, 16)
    for i, t in enumerate(ins):
        ref = reference_of(t, grads=False)
        assert_close(f"o[{i}]", o[i], ref["o"], TOL32)
        assert_close(f"final_state[{i}]", ht[i], ref["ht"], TOL32)
    # only q mapped: the rest broadcast
    o2 = torch.func.vmap(lambda q: _fwd(q, *(ins[0][n] for n in LEAVES[1:]))[0])(s["q"])
    for i, t in enumerate(ins):
        ref = reference_of(dict(ins[0], q=t["q"]), grads=False)
        assert_close(f"o (q mapped)[{i}]", o2[i], ref["o"], TOL32)


def test_torch_func_vmap_of_grad_gives_per_sample_gradients():
    ins, s = _stacked(2, 30)

    def loss(q, k, v, g, beta, h0, do, dht):
        o, ht = _fwd(q, k, v, g, beta, h0)
        return (o * do).sum() + (ht * dht).sum()

    grads = torch.func.vmap(torch.func.grad(loss, argnums=tuple(range(6))))(
        *(s[n] for n in LEAVES + ("do", "dht")))
    for i, t in enumerate(ins):
        ref = reference_of(t)
        for name, g in zip(GRAD_NAMES, grads):
            assert_close(f"{name}[{i}]", g[i], ref[name], TOL32)
    # and backward through a vmapped forward
    q = s["q"].clone().requires_grad_()
    o, ht = torch.func.vmap(_fwd)(q, *(s[n] for n in LEAVES[1:]))
    ((o * s["do"]).sum() + (ht * s["dht"]).sum()).backward()
    for i, t in enumerate(ins):
        assert_close(f"dq[{i}]", q.grad[i], reference_of(t)["dq"], TOL32)


def test_torch_func_vmap_with_cu_seqlens_calls_per_member():
    ins = [cast_inputs_torch(make_inputs(1, 50, 1, 2, 16, 16, seed=40 + i, seqlens=[20, 30],
                                         dht=True), "float32") for i in range(2)]
    s = {n: torch.stack([t[n] for t in ins]) for n in LEAVES + ("do", "dht")}
    cu = ins[0]["cu_seqlens"]

    def loss(q, k, v, g, beta, h0, do, dht):
        o, ht = flashqla.gdn_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                   cu_seqlens=cu)
        return (o * do).sum() + (ht * dht).sum()

    grads = torch.func.vmap(torch.func.grad(loss, argnums=(0, 5)))(
        *(s[n] for n in LEAVES + ("do", "dht")))
    for i, t in enumerate(ins):
        ref = reference_of(t)
        assert_close(f"dq[{i}]", grads[0][i], ref["dq"], TOL32)
        assert_close(f"dh0[{i}]", grads[1][i], ref["dh0"], TOL32)
