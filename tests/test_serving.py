"""The serving path (issue 11) on the CPU backend, against the float64
reference: fused gates (forward, backward, recurrent, FLA names), pool-indexed
prefill (equal bit for bit to gather -> gdn_chunk -> scatter), prefix-cache
checkpoints, speculative verify with intermediate states and gdn_commit, and
the [V, K] state layout on every function that takes or returns states.
The same checks on CUDA are in tests/test_gpu_serving.py."""

import numpy as np
import pytest

import flashqla
from flashqla import reference as R
from gdn_testing import assert_close, make_inputs, raw_gates, tolerance, to_f64

HV, H, K, V = 4, 2, 32, 32


def _f(x, dt=np.float64):
    """A fresh contiguous copy in dtype dt (pools are written in place)."""
    return None if x is None else np.array(x, dtype=dt, order="C", copy=True)


def _vk(x):
    """[.., K, V] <-> [.., V, K]"""
    return np.ascontiguousarray(np.swapaxes(x, -1, -2))


def _raw_gates(B, T, seed=0, dt_bias=True):
    return raw_gates(B, T, HV, seed, dt_bias)


# ------------------------------------------------------------ fused gates ----

@pytest.mark.parametrize("use_gate,use_sig,dt_bias", [(True, True, True), (True, False, False),
                                                      (False, True, True)])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_fused_gates_chunk_forward_backward(use_gate, use_sig, dt_bias, dtype):
    inp = make_inputs(1, 150, H, HV, K, V, seed=1, seqlens=[70, 0, 80], dht=True)
    a, b, A_log, dtb = _raw_gates(1, 150, seed=2, dt_bias=dt_bias)
    gin = a if use_gate else inp["g"]
    bin_ = b if use_sig else inp["beta"]
    g, beta = R.gates(gin, bin_, A_log=A_log, dt_bias=dtb, use_gate_in_kernel=use_gate,
                      use_beta_sigmoid_in_kernel=use_sig)
    dt = np.float64 if dtype == "float64" else np.float32
    q, k, v, h0 = (_f(inp[n], dt) for n in ("q", "k", "v", "h0"))
    kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=inp["cu_seqlens"],
              use_gate_in_kernel=use_gate, A_log=_f(A_log, dt), dt_bias=_f(dtb, dt),
              use_beta_sigmoid_in_kernel=use_sig)
    o, ht, ctx = flashqla.gdn_chunk_fwd(q, k, v, _f(gin, dt), _f(bin_, dt), **kw)
    ro, rht = R.forward(q, k, v, g, beta, initial_state=h0, cu_seqlens=inp["cu_seqlens"])
    tol = tolerance(dtype, "o")
    assert_close("o", o, ro, tol)
    assert_close("ht", ht, rht, tol)
    grads = flashqla.gdn_chunk_bwd(ctx, _f(inp["do"], dt), _f(inp["dht"], dt))
    rg = R.backward(q, k, v, g, beta, inp["do"], dfinal_state=inp["dht"], initial_state=h0,
                    cu_seqlens=inp["cu_seqlens"])
    da, db, dA, ddt = R.gates_backward(gin, bin_, rg[3], rg[4], A_log=A_log, dt_bias=dtb,
                                       use_gate_in_kernel=use_gate,
                                       use_beta_sigmoid_in_kernel=use_sig)
    assert len(grads) == (8 if use_gate else 6)
    names = ["dq", "dk", "dv", "dg", "dbeta", "dh0"]
    want = [rg[0], rg[1], rg[2], da, db, rg[5]]
    if use_gate:
        names += ["dg", "dg"]
        want += [dA, ddt]
    for i, (name, w) in enumerate(zip(names, want)):
        if w is None:
            assert grads[i] is None
            continue
        assert_close(f"grad {i} ({name})", grads[i], w, tolerance(dtype, name))
    if use_gate:
        assert grads[6].dtype == np.dtype(dt) and grads[6].shape == (HV,)


def test_fused_gates_torch_autograd_gradcheck():
    """float64 autograd through the fused gates (a, b, A_log, dt_bias) and the
    chunked backward, against finite differences (q, k, v, h0 are covered by
    the existing gradchecks and held fixed here)."""
    torch = pytest.importorskip("torch")
    inp = make_inputs(1, 20, 1, 2, 16, 16, seed=3, seqlens=[9, 11])
    rng = np.random.default_rng(4)
    t = lambda x, r=True: torch.tensor(x, dtype=torch.float64, requires_grad=r)
    q, k, v, h0 = (t(inp[n], False) for n in ("q", "k", "v", "h0"))
    a = t(rng.standard_normal((1, 20, 2)))
    b = t(rng.standard_normal((1, 20, 2)))
    A_log = t(np.log([0.3, 2.0]))
    dtb = t(rng.standard_normal(2))
    cu = torch.tensor(inp["cu_seqlens"])

    def f(a, b, A_log, dtb):
        return flashqla.gdn_chunk(q, k, v, a, b, initial_state=h0, output_final_state=True,
                                  cu_seqlens=cu, use_gate_in_kernel=True, A_log=A_log,
                                  dt_bias=dtb, use_beta_sigmoid_in_kernel=True)

    assert torch.autograd.gradcheck(f, (a, b, A_log, dtb), eps=1e-6, atol=1e-6, fast_mode=True)


def test_fused_gates_bf16_torch_and_fla_names():
    torch = pytest.importorskip("torch")
    inp = make_inputs(2, 100, H, HV, K, V, seed=5)
    a, b, A_log, dtb = _raw_gates(2, 100, seed=6)
    bf = lambda x: torch.tensor(x).to(torch.bfloat16)
    q, k, v = (bf(inp[n]) for n in ("q", "k", "v"))
    at, bt = bf(a).requires_grad_(), bf(b).requires_grad_()
    Al = torch.tensor(A_log, dtype=torch.float32, requires_grad=True)
    dt = torch.tensor(dtb, dtype=torch.float32, requires_grad=True)
    o, _ = flashqla.chunk_gated_delta_rule(q, k, v, at, bt, use_beta_sigmoid_in_kernel=True,
                                           use_gate_in_kernel=True, A_log=Al, dt_bias=dt)
    g, beta = R.gates(to_f64(at), to_f64(bt), A_log=A_log, dt_bias=dtb, use_gate_in_kernel=True,
                      use_beta_sigmoid_in_kernel=True)
    ro, _ = R.forward(to_f64(q), to_f64(k), to_f64(v), g, beta)
    assert_close("o", o, ro, tolerance("bfloat16", "o"))
    do = torch.tensor(inp["do"]).to(torch.bfloat16)
    o.backward(do)
    rg = R.backward(to_f64(q), to_f64(k), to_f64(v), g, beta, to_f64(do))
    da, db, dA, ddt = R.gates_backward(to_f64(at), to_f64(bt), rg[3], rg[4], A_log=A_log,
                                       dt_bias=dtb, use_gate_in_kernel=True,
                                       use_beta_sigmoid_in_kernel=True)
    assert at.grad.dtype == torch.bfloat16 and Al.grad.dtype == torch.float32
    assert_close("da", at.grad, da, tolerance("bfloat16", "dg"))
    assert_close("db", bt.grad, db, tolerance("bfloat16", "dbeta"))
    assert_close("dA_log", Al.grad, dA, tolerance("bfloat16", "dg"))
    assert_close("ddt_bias", dt.grad, ddt, tolerance("bfloat16", "dg"))


def test_fused_gates_recurrent():
    inp = make_inputs(3, 5, H, HV, K, V, seed=7)
    a, b, A_log, dtb = _raw_gates(3, 5, seed=8)
    pool = np.random.default_rng(9).standard_normal((4, HV, K, V))
    idx = np.array([2, -1, 0])
    g, beta = R.gates(a, b, A_log=A_log, dt_bias=dtb, use_gate_in_kernel=True,
                      use_beta_sigmoid_in_kernel=True)
    ro, rpool = R.recurrent(inp["q"], inp["k"], inp["v"], g, beta, pool, state_indices=idx)
    for dt in (np.float64, np.float32):
        p = _f(pool, dt)
        o = flashqla.gdn_recurrent(*(_f(inp[n], dt) for n in ("q", "k", "v")), _f(a, dt), _f(b, dt),
                                   p, state_indices=idx, use_gate_in_kernel=True,
                                   A_log=_f(A_log, dt), dt_bias=_f(dtb, dt),
                                   use_beta_sigmoid_in_kernel=True)
        name = "float64" if dt == np.float64 else "float32"
        assert_close("o", o, ro, tolerance(name, "o"))
        assert_close("pool", p, rpool, tolerance(name, "ht"))


def test_fused_gates_bad_arguments():
    inp = make_inputs(1, 10, H, HV, K, V, seed=1)
    args = [inp[n] for n in ("q", "k", "v", "g", "beta")]
    with pytest.raises(ValueError, match="A_log"):
        flashqla.gdn_chunk(*args, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="A_log"):
        flashqla.gdn_chunk(*args, use_gate_in_kernel=True, A_log=np.zeros(HV + 1))
    with pytest.raises(ValueError, match="dt_bias"):
        flashqla.gdn_chunk(*args, use_gate_in_kernel=True, A_log=np.zeros(HV),
                           dt_bias=np.zeros((1, HV)))
    # without use_gate_in_kernel A_log is ignored, as in FLA
    o, _ = flashqla.gdn_chunk(*args, A_log=np.zeros(HV))
    o2, _ = flashqla.gdn_chunk(*args)
    assert np.array_equal(o, o2)


# ------------------------------------------------------ pool-indexed prefill ----

def _pool_case(layout="kv", seed=10):
    inp = make_inputs(1, 210, H, HV, K, V, seed=seed, seqlens=[70, 0, 1, 139], h0=False)
    rng = np.random.default_rng(seed + 1)
    pool = rng.standard_normal((7, HV, K, V)) * 0.5
    if layout == "vk":
        pool = _vk(pool)
    idx = np.array([5, -1, 2, -1], dtype=np.int32)
    return inp, pool, idx


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_pool_prefill_equals_gather_chunk_scatter_bitwise(layout, dtype):
    inp, pool, idx = _pool_case(layout)
    dt = np.float64 if dtype == "float64" else np.float32
    args = [_f(inp[n], dt) for n in ("q", "k", "v", "g", "beta")]
    pool = _f(pool, np.float64 if dtype == "float64" else np.float32)
    pool0 = pool.copy()
    # gather -> gdn_chunk -> scatter
    h0 = np.stack([pool[i] if i >= 0 else np.zeros_like(pool[0]) for i in idx])
    o_ref, ht = flashqla.gdn_chunk(*args, initial_state=h0, output_final_state=True,
                                   cu_seqlens=inp["cu_seqlens"], state_layout=layout)
    want = pool0.copy()
    for n, i in enumerate(idx):
        if i >= 0:
            want[i] = ht[n]
    o, none = flashqla.gdn_chunk(*args, state=pool, state_indices=idx,
                                 cu_seqlens=inp["cu_seqlens"], state_layout=layout)
    assert none is None
    assert np.array_equal(o, o_ref)
    assert np.array_equal(pool, want)           # slots 5, 2 written, every other slot as it was
    # and against the float64 reference
    h0kv = h0 if layout == "kv" else _vk(h0)
    ro, rht = R.forward(*args, initial_state=h0kv, cu_seqlens=inp["cu_seqlens"])
    assert_close("o", o, ro, tolerance(dtype, "o"))
    got = pool[5] if layout == "kv" else _vk(pool[5])
    assert_close("slot 5", got, rht[0], tolerance(dtype, "ht"))


def test_pool_prefill_batch_without_indices_and_torch():
    torch = pytest.importorskip("torch")
    inp = make_inputs(2, 90, H, HV, K, V, seed=12)
    pool = torch.tensor(inp["h0"], dtype=torch.float32).clone()
    t = {n: torch.tensor(inp[n], dtype=torch.float32) for n in ("q", "k", "v", "g", "beta")}
    o, ht = flashqla.gdn_chunk(*t.values(), state=pool)   # slot n for sequence n (P == N)
    ro, rht = R.forward(*(inp[n] for n in ("q", "k", "v", "g", "beta")), initial_state=inp["h0"])
    assert ht is None
    assert_close("o", o, ro, tolerance("float32", "o"))
    assert_close("pool", pool, rht, tolerance("float32", "ht"))


def test_pool_prefill_rejects():
    torch = pytest.importorskip("torch")
    inp, pool, idx = _pool_case()
    args = [inp[n] for n in ("q", "k", "v", "g", "beta")]
    cu = inp["cu_seqlens"]
    with pytest.raises(ValueError, match="state_indices: slot 2 appears twice"):
        flashqla.gdn_chunk(*args, state=pool, state_indices=[2, -1, 2, -1], cu_seqlens=cu)
    with pytest.raises(ValueError, match="state_indices"):
        flashqla.gdn_chunk(*args, state=pool, state_indices=[7, -1, 2, -1], cu_seqlens=cu)
    with pytest.raises(ValueError, match="initial_state"):
        flashqla.gdn_chunk(*args, state=pool, state_indices=idx, cu_seqlens=cu,
                           output_final_state=True)
    with pytest.raises(ValueError, match="state_indices"):
        flashqla.gdn_chunk(*args, state_indices=idx, cu_seqlens=cu)
    tq = torch.tensor(inp["q"], requires_grad=True)
    with pytest.raises(ValueError, match="forward only"):
        flashqla.gdn_chunk(tq, *(torch.tensor(x) for x in args[1:]), state=torch.tensor(pool),
                           state_indices=torch.tensor(idx), cu_seqlens=torch.tensor(cu))
    before = pool.copy()
    with pytest.raises(ValueError):
        flashqla.gdn_chunk(*args, state=pool, state_indices=[1, 1, 3, 4], cu_seqlens=cu)
    assert np.array_equal(pool, before)           # nothing written on a rejected call


def test_recurrent_rejects_duplicate_slots():
    inp = make_inputs(3, 1, H, HV, K, V, seed=13)
    pool = np.zeros((4, HV, K, V))
    with pytest.raises(ValueError, match="appears twice"):
        flashqla.gdn_recurrent(*(inp[n] for n in ("q", "k", "v", "g", "beta")), pool,
                               state_indices=[3, -1, 3])
    # repeated negative slots are padding, not duplicates
    flashqla.gdn_recurrent(*(inp[n] for n in ("q", "k", "v", "g", "beta")), pool,
                           state_indices=[-1, 3, -1])


# ---------------------------------------------------------- checkpoints ----

@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_checkpoints_varlen(layout):
    seqlens = [130, 0, 64, 200, 63, 128]
    inp = make_inputs(1, sum(seqlens), H, HV, K, V, seed=14, seqlens=seqlens)
    h0 = inp["h0"] if layout == "kv" else _vk(inp["h0"])
    args = [inp[n] for n in ("q", "k", "v", "g", "beta")]
    o, ht, (ck, cuck) = flashqla.gdn_chunk(*args, initial_state=h0, output_final_state=True,
                                           cu_seqlens=inp["cu_seqlens"], checkpoint_every=64,
                                           state_layout=layout)
    assert cuck.dtype == np.int64
    counts = [L // 64 for L in seqlens]
    assert list(cuck) == list(np.concatenate([[0], np.cumsum(counts)]))
    assert ck.shape == (sum(seqlens) // 64, HV) + ((K, V) if layout == "kv" else (V, K))
    traj = R.states(*args, initial_state=inp["h0"], cu_seqlens=inp["cu_seqlens"])
    for n, L in enumerate(seqlens):
        for c in range(L // 64):
            got = ck[cuck[n] + c] if layout == "kv" else _vk(ck[cuck[n] + c])
            assert_close(f"seq {n} checkpoint {c}", got, traj[n][64 * (c + 1) - 1], 1e-12)
    assert np.all(ck[cuck[-1]:] == 0)          # the bound's spare rows
    ro, rht = R.forward(*args, initial_state=inp["h0"], cu_seqlens=inp["cu_seqlens"])
    assert_close("o", o, ro, 1e-12)


def test_checkpoints_batch_every_128_fp32_and_pool():
    inp = make_inputs(2, 300, H, HV, K, V, seed=15)
    args = [_f(inp[n], np.float32) for n in ("q", "k", "v", "g", "beta")]
    pool = _f(inp["h0"], np.float32)
    o, ht, (ck, cuck) = flashqla.gdn_chunk(*args, state=pool, checkpoint_every=128)
    assert ht is None and ck.shape == (4, HV, K, V) and list(cuck) == [0, 2, 4]
    traj = R.states(*args, initial_state=inp["h0"])
    for n in range(2):
        for c in range(2):
            assert_close("checkpoint", ck[2 * n + c], traj[n][128 * (c + 1) - 1],
                         tolerance("float32", "ht"))


def test_checkpoints_rejects():
    torch = pytest.importorskip("torch")
    inp = make_inputs(1, 70, H, HV, K, V, seed=16)
    args = [inp[n] for n in ("q", "k", "v", "g", "beta")]
    for bad in (0, 32, 100, -64, 64.0, True):
        with pytest.raises(ValueError, match="checkpoint_every"):
            flashqla.gdn_chunk(*args, checkpoint_every=bad)
    tq = torch.tensor(inp["q"], requires_grad=True)
    with pytest.raises(ValueError, match="forward only"):
        flashqla.gdn_chunk(tq, *(torch.tensor(x) for x in args[1:]), checkpoint_every=64)
    # T < checkpoint_every: no rows, empty index
    o, ht, (ck, cuck) = flashqla.gdn_chunk(*args, checkpoint_every=128)
    assert ck.shape[0] == 0 and list(cuck) == [0, 0]


# ---------------------------------------------------- speculative verify ----

@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_verify_intermediate_states_and_commit(layout, dtype):
    N, T = 4, 5
    dt = np.float64 if dtype == "float64" else np.float32
    inp = make_inputs(N, T, H, HV, K, V, seed=17)
    args = [_f(inp[n], dt) for n in ("q", "k", "v", "g", "beta")]
    pool_kv = np.random.default_rng(18).standard_normal((6, HV, K, V)) * 0.5
    pool = _f(pool_kv if layout == "kv" else _vk(pool_kv), dt)
    pool0 = pool.copy()
    idx = np.array([4, -1, 0, 2], dtype=np.int64)
    sd = (K, V) if layout == "kv" else (V, K)
    buf = np.full((N, T, HV) + sd, np.nan, dtype=dt)
    o = flashqla.gdn_recurrent(*args, pool, state_indices=idx, intermediate_states=buf,
                               update_state=False, state_layout=layout)
    assert np.array_equal(pool, pool0)          # verify: the pool untouched
    h0 = np.stack([pool_kv[i] if i >= 0 else np.zeros((HV, K, V)) for i in idx])
    traj = R.states(*args, initial_state=h0)
    ro, _ = R.recurrent(*args, pool_kv, state_indices=idx)
    assert_close("o", o, ro, tolerance(dtype, "o"))
    for n in (0, 2, 3):
        got = buf[n] if layout == "kv" else _vk(buf[n])
        assert_close(f"states of {n}", got, traj[n], tolerance(dtype, "ht"))
    assert np.isnan(buf[1]).all()               # padding: nothing written
    # the same step with update_state=True leaves the last state in the pool
    p2 = pool0.copy()
    o2 = flashqla.gdn_recurrent(*args, p2, state_indices=idx, state_layout=layout)
    assert np.array_equal(o2, o)
    assert np.array_equal(p2[4], buf[0, -1]) and np.array_equal(p2[2], buf[3, -1])
    # commit: sequence 0 accepted 2 tokens, 2 none, 3 all
    acc = np.array([2, 3, 0, T], dtype=np.int32)
    flashqla.gdn_commit(pool, buf, idx, acc, state_layout=layout)
    assert np.array_equal(pool[4], buf[0, 1])
    assert np.array_equal(pool[0], pool0[0])    # num_accepted = 0 keeps the slot
    assert np.array_equal(pool[2], buf[3, T - 1])
    for s in (1, 3, 5):
        assert np.array_equal(pool[s], pool0[s])


def test_verify_varlen_and_commit_rejects():
    seqlens = [3, 1, 4]
    inp = make_inputs(1, 8, H, HV, K, V, seed=19, seqlens=seqlens)
    args = [inp[n] for n in ("q", "k", "v", "g", "beta")]
    cu = inp["cu_seqlens"]
    pool = np.random.default_rng(20).standard_normal((3, HV, K, V))
    buf = np.full((3, 4, HV, K, V), np.nan)
    o = flashqla.gdn_recurrent(*args, pool.copy(), cu_seqlens=cu, intermediate_states=buf)
    traj = R.states(*args, initial_state=pool, cu_seqlens=cu)
    for n, L in enumerate(seqlens):
        assert_close(f"states of {n}", buf[n, :L], traj[n], 1e-12)
        assert np.isnan(buf[n, L:]).all()
    with pytest.raises(ValueError, match="intermediate_states"):
        flashqla.gdn_recurrent(*args, pool.copy(), cu_seqlens=cu,
                               intermediate_states=np.zeros((3, 3, HV, K, V)))
    inp1 = make_inputs(2, 3, H, HV, K, V, seed=21)
    with pytest.raises(ValueError, match="intermediate_states"):
        flashqla.gdn_recurrent(*(inp1[n] for n in ("q", "k", "v", "g", "beta")),
                               np.zeros((2, HV, K, V)), intermediate_states=np.zeros((2, 2, HV, K, V)))
    p = pool.copy()
    with pytest.raises(ValueError, match="num_accepted"):
        flashqla.gdn_commit(p, buf, None, [1, 5, 0])
    with pytest.raises(ValueError, match="num_accepted"):
        flashqla.gdn_commit(p, buf, None, [1, -1, 0])
    with pytest.raises(ValueError, match="appears twice"):
        flashqla.gdn_commit(p, buf, [0, 0, -1], [1, 1, 0])
    with pytest.raises(ValueError, match="intermediate_states"):
        flashqla.gdn_commit(p, np.zeros((3, 4, HV, V + 1, K)), None, [1, 1, 1])
    with pytest.raises(TypeError, match="num_accepted"):
        flashqla.gdn_commit(p, buf, None, [1.5, 1, 1])
    assert np.array_equal(p, pool)               # nothing written on a rejected call
    flashqla.gdn_commit(p, buf, None, [3, 1, 0])   # without indices: slot n
    assert np.array_equal(p[0], buf[0, 2]) and np.array_equal(p[1], buf[1, 0])
    assert np.array_equal(p[2], pool[2])


def test_verify_torch_readonly_pool_allowed_without_update():
    torch = pytest.importorskip("torch")
    inp = make_inputs(2, 2, H, HV, K, V, seed=22)
    t = [torch.tensor(inp[n], dtype=torch.float32) for n in ("q", "k", "v", "g", "beta")]
    pool = torch.randn(2, HV, K, V)
    buf = torch.full((2, 2, HV, K, V), float("nan"))
    before = pool.clone()
    o = flashqla.gdn_recurrent(*t, pool, intermediate_states=buf, update_state=False)
    assert torch.equal(pool, before) and torch.isfinite(buf).all()
    flashqla.gdn_commit(pool, buf, torch.tensor([1, 0]), torch.tensor([1, 2]))
    assert torch.equal(pool[1], buf[0, 0]) and torch.equal(pool[0], buf[1, 1])


# ------------------------------------------------------------ vk layout ----

def test_vk_layout_chunk_autograd_matches_kv():
    torch = pytest.importorskip("torch")
    inp = make_inputs(1, 100, H, HV, K, V, seed=23, seqlens=[40, 60], dht=True)
    mk = lambda x: torch.tensor(x, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor(inp["cu_seqlens"])
    res = {}
    for layout in ("kv", "vk"):
        xs = [mk(inp[n]) for n in ("q", "k", "v", "g", "beta")]
        h0 = mk(inp["h0"] if layout == "kv" else _vk(inp["h0"]))
        o, ht = flashqla.gdn_chunk(*xs, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                   state_layout=layout)
        dht = torch.tensor(inp["dht"] if layout == "kv" else _vk(inp["dht"]))
        (o * torch.tensor(inp["do"])).sum().add((ht * dht).sum()).backward()
        tr = (lambda x: x) if layout == "kv" else (lambda x: x.transpose(-1, -2))
        res[layout] = [o.detach(), tr(ht.detach())] + [x.grad for x in xs] + [tr(h0.grad)]
    for a, b in zip(res["kv"], res["vk"]):
        assert torch.equal(a, b)
    # FLA's name for it
    xs = [torch.tensor(inp[n]) for n in ("q", "k", "v", "g", "beta")]
    o, ht = flashqla.chunk_gated_delta_rule(*xs, initial_state=torch.tensor(_vk(inp["h0"])),
                                            output_final_state=True, cu_seqlens=cu,
                                            state_v_first=True)
    assert torch.equal(ht.transpose(-1, -2), res["kv"][1])
    with pytest.raises(ValueError, match="state_layout"):
        flashqla.gdn_chunk(*xs, state_layout="KV")


def test_vk_layout_jax():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import flashqla.jax as fqj
    inp = make_inputs(1, 70, H, HV, K, V, seed=24)
    xs = [jnp.asarray(inp[n], dtype=jnp.float32) for n in ("q", "k", "v", "g", "beta")]
    a, b, A_log, dtb = _raw_gates(1, 70, seed=25)
    o, ht = fqj.gdn_chunk(*xs[:3], jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32),
                          initial_state=jnp.asarray(_vk(inp["h0"]), jnp.float32),
                          output_final_state=True, state_layout="vk", use_gate_in_kernel=True,
                          A_log=jnp.asarray(A_log, jnp.float32), dt_bias=jnp.asarray(dtb, jnp.float32),
                          use_beta_sigmoid_in_kernel=True)
    g, beta = R.gates(a, b, A_log=A_log, dt_bias=dtb, use_gate_in_kernel=True,
                      use_beta_sigmoid_in_kernel=True)
    ro, rht = R.forward(inp["q"], inp["k"], inp["v"], g, beta, initial_state=inp["h0"])
    assert_close("o", o, ro, tolerance("float32", "o"))
    assert_close("ht", _vk(np.asarray(ht)), rht, tolerance("float32", "ht"))

    def loss(A_log_):
        o, _ = fqj.gdn_chunk(*xs[:3], jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32),
                             use_gate_in_kernel=True, A_log=A_log_,
                             dt_bias=jnp.asarray(dtb, jnp.float32), use_beta_sigmoid_in_kernel=True)
        return (o * jnp.asarray(inp["do"], jnp.float32)).sum()
    dA = jax.grad(loss)(jnp.asarray(A_log, jnp.float32))
    g0, b0 = R.gates(a, b, A_log=A_log, dt_bias=dtb, use_gate_in_kernel=True,
                     use_beta_sigmoid_in_kernel=True)
    rg = R.backward(inp["q"], inp["k"], inp["v"], g0, b0, inp["do"])
    _, _, rdA, _ = R.gates_backward(a, b, rg[3], rg[4], A_log=A_log, dt_bias=dtb,
                                    use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    assert_close("dA_log", dA, rdA, tolerance("float32", "dg"))


# ------------------------------------------------------ torch operators ----

def test_opcheck_serving_ops():
    """torch.library.opcheck of the operators with the serving options: the
    fused-gate chunk forward (with gradients through A_log, dt_bias) and
    backward, chunk_fwd_serving (pool + checkpoints), recurrent with
    intermediate states, commit."""
    torch = pytest.importorskip("torch")
    import flashqla._torch  # noqa: F401  (registers torch.ops.flashqla.*)
    inp = make_inputs(1, 140, 1, 2, 16, 16, seed=30, seqlens=[64, 76], dht=True)
    a, b, A_log, dtb = (x[..., :2] if x.ndim > 1 else x[:2] for x in _raw_gates(1, 140, seed=31))
    f = lambda x, r=False: torch.tensor(x, dtype=torch.float32).requires_grad_(r)  # noqa: E731
    cu = torch.tensor(inp["cu_seqlens"])
    for grad in (False, True):
        args = [f(inp[n], grad) for n in ("q", "k", "v")] + [f(a, grad), f(b, grad),
                                                             f(inp["h0"], grad)]
        torch.library.opcheck(torch.ops.flashqla.chunk_fwd.default,
                              tuple(args) + (cu, 0.25, True, False, f(A_log, grad), f(dtb, grad),
                                             True, True, "vk"))
    args = [f(inp[n]) for n in ("q", "k", "v")] + [f(a), f(b), f(inp["h0"])]
    torch.library.opcheck(torch.ops.flashqla.chunk_bwd.default,
                          tuple(args) + (cu, f(inp["do"]), f(inp["dht"]), 0.25, False, f(A_log),
                                         f(dtb), True, True, "kv"))
    pool = torch.randn(3, 2, 16, 16)
    torch.library.opcheck(torch.ops.flashqla.chunk_fwd_serving.default,
                          tuple(args[:5]) + (None, cu, pool, torch.tensor([2, -1]), 0.25, False,
                                             False, f(A_log), None, True, False, "kv", 64))
    d = make_inputs(2, 3, 1, 2, 16, 16, seed=32)
    rec = [f(d[n]) for n in ("q", "k", "v", "g", "beta")]
    buf = torch.zeros(2, 3, 2, 16, 16)
    torch.library.opcheck(torch.ops.flashqla.recurrent.default,
                          tuple(rec) + (pool, torch.tensor([0, 2]), None, 0.25, False, buf, False,
                                        "vk", None, None, False, False))
    torch.library.opcheck(torch.ops.flashqla.commit.default,
                          (pool, buf, torch.tensor([0, 2]), torch.tensor([1, 3]), "kv"))


def test_torch_compile_verify_and_commit():
    torch = pytest.importorskip("torch")
    inp = make_inputs(2, 3, H, HV, K, V, seed=33)
    t = [torch.tensor(inp[n], dtype=torch.float32) for n in ("q", "k", "v", "g", "beta")]
    pool = torch.randn(4, HV, V, K)
    buf = torch.zeros(2, 3, HV, V, K)
    idx, acc = torch.tensor([3, 1]), torch.tensor([2, 0])

    def step(q, k, v, g, beta):
        o = flashqla.gdn_recurrent(q, k, v, g, beta, pool, state_indices=idx,
                                   intermediate_states=buf, update_state=False, state_layout="vk")
        flashqla.gdn_commit(pool, buf, idx, acc, state_layout="vk")
        return o

    ref_pool = pool.clone()
    o_ref = flashqla.gdn_recurrent(*t, ref_pool.clone(), state_indices=idx, state_layout="vk")
    o = torch.compile(step, fullgraph=True, backend="eager")(*t)
    assert torch.equal(o, o_ref)
    assert torch.equal(pool[3], buf[0, 1]) and torch.equal(pool[1], ref_pool[1])
