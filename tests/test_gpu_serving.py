"""The serving path (issue 11) on the CUDA backend: fused gates through the
chunk forward and backward (pre-/post-pass kernels, deterministic dA_log /
ddt_bias), pool-indexed prefill equal bit for bit to gather -> gdn_chunk ->
scatter, checkpoints, the [V, K] layout, the recurrent step (decode, verify
with intermediate states, update_state=False, fused gates) against the float64
reference, gdn_commit, and a CUDA-graph capture of a verify + commit step.

Every test here is marked `gpu` (skipped without a CUDA device or without the
CUDA build, see conftest.py). Tolerances: DESIGN §3's bf16 budget (the CUDA
chunk stages round to bf16 for the tensor cores); the recurrent step computes
in fp32 from its inputs, so fp32 inputs are held to 1e-4 there.
"""

import numpy as np
import pytest

import flashqla
from flashqla import reference as R
from gdn_testing import (TOL_BF16_DG, TOL_BF16_GRAD, TOL_BF16_OUT, assert_close, make_inputs,
                         pool_prefill_matches_gather, raw_gates, to_f64)

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

H, HV, K, V = 2, 4, 128, 128
DEV = "cuda"


def _t(x, dtype=torch.float32):
    return None if x is None else torch.as_tensor(np.asarray(x)).to(DEV).to(dtype).contiguous()


def _vk(x):
    return x.transpose(-1, -2).contiguous()


def _raw_gates(B, T, seed=0, dt_bias=True):
    return raw_gates(B, T, HV, seed, dt_bias)


def _qkv(inp, dtype=torch.bfloat16):
    return [_t(inp[n], dtype) for n in ("q", "k", "v")]


# ------------------------------------------------------------ fused gates ----

def _assert_gate_sums(dA_out, ddt_out, dg_ref, g_ref, da_ref, dA_ref, ddt_ref):
    """dA_log[j] = sum_t dg[t, j] g[t, j] and ddt_bias[j] = sum_t da[t, j]: sums
    over every token, each term carrying dg's (da's) error, so their error
    bound is what dg's own tolerance implies by Cauchy-Schwarz, per head j:
        |dA_log - ref| <= tol ||dg_ref[:, j]|| ||g[:, j]||,
        |ddt_bias - ref| <= tol ||da_ref[:, j]|| sqrt(tokens)
    (a relative check of the few summed values amplifies the cancellation
    in the sum: a head whose terms nearly cancel cannot be held to 2e-2 of
    its sum). A sum missing tokens or heads is off by far more."""
    tol = TOL_BF16_DG
    dg2 = np.asarray(dg_ref, np.float64).reshape(-1, HV)
    g2 = np.asarray(g_ref, np.float64).reshape(-1, HV)
    bound = tol * np.linalg.norm(dg2, axis=0) * np.linalg.norm(g2, axis=0)
    err = np.abs(to_f64(dA_out) - dA_ref)
    assert (err <= bound).all(), f"dA_log: |error| {err} > bound {bound}"
    if ddt_ref is not None:
        da2 = np.asarray(da_ref, np.float64).reshape(-1, HV)
        bound = tol * np.linalg.norm(da2, axis=0) * np.sqrt(da2.shape[0])
        err = np.abs(to_f64(ddt_out) - ddt_ref)
        assert (err <= bound).all(), f"ddt_bias: |error| {err} > bound {bound}"


@pytest.mark.parametrize("gate_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_gate,use_sig,dt_bias", [(True, True, True), (True, False, False),
                                                      (False, True, True)])
def test_cuda_fused_gates_forward_backward(use_gate, use_sig, dt_bias, gate_dtype):
    seqlens = [100, 1, 0, 300]
    inp = make_inputs(1, sum(seqlens), H, HV, K, V, seed=1, seqlens=seqlens, dht=True)
    a, b, A_log, dtb = _raw_gates(1, sum(seqlens), 2, dt_bias)
    gin = _t(a if use_gate else inp["g"], gate_dtype)
    bin_ = _t(b if use_sig else inp["beta"], gate_dtype)
    g, beta = R.gates(to_f64(gin), to_f64(bin_), A_log=A_log, dt_bias=dtb,
                      use_gate_in_kernel=use_gate, use_beta_sigmoid_in_kernel=use_sig)
    q, k, v = _qkv(inp)
    h0, cu = _t(inp["h0"]), _t(inp["cu_seqlens"], torch.int64)
    kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu, use_gate_in_kernel=use_gate,
              A_log=_t(A_log), dt_bias=_t(dtb), use_beta_sigmoid_in_kernel=use_sig)
    o, ht, ctx = flashqla.gdn_chunk_fwd(q, k, v, gin, bin_, **kw)
    f = [to_f64(x) for x in (q, k, v)]
    ro, rht = R.forward(*f, g, beta, initial_state=inp["h0"], cu_seqlens=inp["cu_seqlens"])
    assert_close("o", o, ro, TOL_BF16_OUT)
    assert_close("ht", ht, rht, TOL_BF16_OUT)
    do, dht = _t(inp["do"], torch.bfloat16), _t(inp["dht"])
    grads = flashqla.gdn_chunk_bwd(ctx, do, dht)
    rg = R.backward(*f, g, beta, to_f64(do), dfinal_state=inp["dht"], initial_state=inp["h0"],
                    cu_seqlens=inp["cu_seqlens"])
    da, db, dA, ddt = R.gates_backward(to_f64(gin), to_f64(bin_), rg[3], rg[4], A_log=A_log,
                                       dt_bias=dtb, use_gate_in_kernel=use_gate,
                                       use_beta_sigmoid_in_kernel=use_sig)
    assert grads[3].dtype == gate_dtype and grads[4].dtype == gate_dtype
    assert_close("da", grads[3], da, TOL_BF16_DG)
    assert_close("db", grads[4], db, TOL_BF16_GRAD)
    assert_close("dh0", grads[5], rg[5], TOL_BF16_GRAD)
    if use_gate:
        _assert_gate_sums(grads[6], grads[7], rg[3], g, da, dA, ddt if dt_bias else None)
        if not dt_bias:
            assert grads[7] is None
        again = flashqla.gdn_chunk_bwd(ctx, do, dht)   # deterministic sums
        assert torch.equal(again[6], grads[6])
        if dt_bias:
            assert torch.equal(again[7], grads[7])


def test_cuda_fused_gates_autograd_and_fla_names():
    inp = make_inputs(2, 200, H, HV, K, V, seed=3)
    a, b, A_log, dtb = _raw_gates(2, 200, 4)
    q, k, v = _qkv(inp)
    at, bt = _t(a).requires_grad_(), _t(b).requires_grad_()
    Al, dt = _t(A_log).requires_grad_(), _t(dtb).requires_grad_()
    o, _ = flashqla.chunk_gated_delta_rule(q, k, v, at, bt, use_beta_sigmoid_in_kernel=True,
                                           use_gate_in_kernel=True, A_log=Al, dt_bias=dt)
    g, beta = R.gates(a, b, A_log=A_log, dt_bias=dtb, use_gate_in_kernel=True,
                      use_beta_sigmoid_in_kernel=True)
    f = [to_f64(x) for x in (q, k, v)]
    assert_close("o", o, R.forward(*f, g, beta)[0], TOL_BF16_OUT)
    do = _t(inp["do"], torch.bfloat16)
    o.backward(do)
    rg = R.backward(*f, g, beta, to_f64(do))
    da, db, dA, ddt = R.gates_backward(a, b, rg[3], rg[4], A_log=A_log, dt_bias=dtb,
                                       use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    assert_close("da", at.grad, da, TOL_BF16_DG)
    assert_close("db", bt.grad, db, TOL_BF16_GRAD)
    _assert_gate_sums(Al.grad, dt.grad, rg[3], g, da, dA, ddt)


# ------------------------------------------------------ pool-indexed prefill ----

@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_cuda_pool_prefill_equals_gather_chunk_scatter_bitwise(layout, idx_dtype):
    seqlens = [70, 0, 1, 2500, 64]   # 2500: 40 chunks, split in 3 segments (the pool read and written by different CTAs)
    inp = make_inputs(1, sum(seqlens), H, HV, K, V, seed=5, seqlens=seqlens, h0=False)
    args = _qkv(inp) + [_t(inp["g"]), _t(inp["beta"])]
    cu = _t(inp["cu_seqlens"], torch.int32)
    pool = torch.randn(9, HV, K, V, device=DEV) * 0.5
    if layout == "vk":
        pool = _vk(pool)
    idx = torch.tensor([5, -1, 2, 8, -1], dtype=idx_dtype, device=DEV)
    # gather -> gdn_chunk -> scatter, bit for bit
    o, got, h0, _, _ = pool_prefill_matches_gather(args, pool, idx, cu, layout)
    # and against the float64 reference
    h0kv = h0 if layout == "kv" else _vk(h0)
    ro, rht = R.forward(*(to_f64(x) for x in args), initial_state=to_f64(h0kv),
                        cu_seqlens=inp["cu_seqlens"])
    assert_close("o", o, ro, TOL_BF16_OUT)
    s3 = got[8] if layout == "kv" else _vk(got[8])
    assert_close("slot 8", s3, rht[3], TOL_BF16_OUT)


# ---------------------------------------------------------- checkpoints ----

@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_cuda_checkpoints(layout):
    seqlens = [130, 0, 64, 2700, 63, 128]   # 2700: 43 chunks in 3 segments (checkpoints from each)
    inp = make_inputs(1, sum(seqlens), H, HV, K, V, seed=6, seqlens=seqlens)
    args = _qkv(inp) + [_t(inp["g"]), _t(inp["beta"])]
    h0 = _t(inp["h0"])
    if layout == "vk":
        h0 = _vk(h0)
    o, ht, (ck, cuck) = flashqla.gdn_chunk(*args, initial_state=h0, output_final_state=True,
                                           cu_seqlens=_t(inp["cu_seqlens"], torch.int64),
                                           checkpoint_every=64, state_layout=layout)
    counts = [L // 64 for L in seqlens]
    assert cuck.dtype == torch.int64
    assert cuck.cpu().tolist() == list(np.concatenate([[0], np.cumsum(counts)]))
    assert ck.shape[0] == sum(seqlens) // 64
    traj = R.states(*(to_f64(x) for x in args), initial_state=inp["h0"],
                    cu_seqlens=inp["cu_seqlens"])
    c0 = cuck.cpu().tolist()
    for n, L in enumerate(seqlens):
        for c in range(L // 64):
            x = ck[c0[n] + c]
            assert_close(f"seq {n} ckpt {c}", x if layout == "kv" else _vk(x),
                         traj[n][64 * (c + 1) - 1], TOL_BF16_OUT)
        if L and L % 64 == 0:   # the last checkpoint is the final state, bit for bit
            assert torch.equal(ck[c0[n + 1] - 1], ht[n])
    assert torch.all(ck[c0[-1]:] == 0)
    # same o with and without checkpoints (one kernel stores them from its registers)
    o2, _ = flashqla.gdn_chunk(*args, initial_state=h0, output_final_state=True,
                               cu_seqlens=_t(inp["cu_seqlens"], torch.int64), state_layout=layout)
    assert torch.equal(o, o2)


# ------------------------------------------------------------ vk layout ----

def test_cuda_vk_layout_forward_backward_bitwise():
    inp = make_inputs(2, 300, H, HV, K, V, seed=7, dht=True)
    res = {}
    for layout in ("kv", "vk"):
        xs = [x.requires_grad_() for x in _qkv(inp) + [_t(inp["g"]), _t(inp["beta"])]]
        h0 = _t(inp["h0"])
        dht = _t(inp["dht"])
        if layout == "vk":
            h0, dht = _vk(h0), _vk(dht)
        h0.requires_grad_()
        o, ht = flashqla.gdn_chunk(*xs, initial_state=h0, output_final_state=True, state_layout=layout)
        torch.autograd.backward([o, ht], [_t(inp["do"], torch.bfloat16), dht])
        tr = (lambda x: x) if layout == "kv" else _vk
        res[layout] = [o.detach(), tr(ht.detach())] + [x.grad for x in xs] + [tr(h0.grad)]
    for a, b in zip(res["kv"], res["vk"]):
        assert torch.equal(a, b)


# ------------------------------------------------------- recurrent step ----

def _rec_inputs(N, T, Hh, HVv, Kk, Vv, seed, dtype, l2norm=False):
    inp = make_inputs(N, T, Hh, HVv, Kk, Vv, seed=seed, normalize_qk=not l2norm)
    return inp, [_t(inp[n], dtype) for n in ("q", "k", "v")]


@pytest.mark.parametrize("N,T", [(1, 1), (3, 1), (17, 1), (5, 4), (2, 9)])
@pytest.mark.parametrize("Kk,Vv", [(128, 128), (64, 64), (64, 128), (256, 256)])
@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_cuda_recurrent_matches_reference(N, T, Kk, Vv, layout):
    Hh, HVv = 2, 4
    for dtype, tol in ((torch.bfloat16, TOL_BF16_OUT), (torch.float32, 1e-4)):
        inp, (q, k, v) = _rec_inputs(N, T, Hh, HVv, Kk, Vv, seed=N * 10 + T, dtype=dtype)
        g, beta = _t(inp["g"]), _t(inp["beta"])
        P = N + 3
        pool_kv = torch.randn(P, HVv, Kk, Vv, device=DEV) * 0.5
        pool = pool_kv.clone() if layout == "kv" else _vk(pool_kv)
        idx = torch.arange(P - 1, P - 1 - N, -1, device=DEV, dtype=torch.int32)
        pad = N // 2 if N > 1 else -1
        if pad >= 0:
            idx[pad] = -1                                  # one padding sequence
        f = [to_f64(x) for x in (q, k, v, g, beta)]
        ro, rpool = R.recurrent(*f, to_f64(pool_kv), state_indices=idx.cpu().numpy())
        sd = (Kk, Vv) if layout == "kv" else (Vv, Kk)
        buf = torch.full((N, T, HVv) + sd, float("nan"), device=DEV)
        before = pool.clone()
        o = flashqla.gdn_recurrent(q, k, v, g, beta, pool, state_indices=idx,
                                   intermediate_states=buf, update_state=False, state_layout=layout)
        assert torch.equal(pool, before)
        assert_close("o (verify)", o, ro, tol)
        h0 = np.stack([to_f64(pool_kv[i]) if i >= 0 else np.zeros((HVv, Kk, Vv))
                       for i in idx.cpu().tolist()])
        traj = R.states(*f, initial_state=h0)
        for n in range(N):
            if n == pad:
                assert torch.isnan(buf[n]).all()
                continue
            x = buf[n] if layout == "kv" else _vk(buf[n])
            assert_close(f"states of {n}", x, traj[n], tol)
        o2 = flashqla.gdn_recurrent(q, k, v, g, beta, pool, state_indices=idx, state_layout=layout)
        assert torch.equal(o2, o)
        got = pool if layout == "kv" else _vk(pool)
        assert_close("pool", got, rpool, tol)
        untouched = [s for s in range(P) if s not in idx.cpu().tolist()]
        assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("N", [20, 80])
def test_cuda_recurrent_many_items_per_block(layout, T, N):
    """Enough items that every resident block of the persistent kernel takes
    several, each prefetched while the one before is computed: N sequences x
    32 value heads x 4 blocks of 32 columns, a shuffled pool with repeated
    padding (-1), the verify path at T = 4. At T = 1 a [K, V] pool takes the
    one-item-per-block decode kernel, a [V, K] pool (2560 and 10240 items, over
    4 per resident block on an H100 / H200) the persistent kernel."""
    Hh, HVv = 16, 32
    inp, (q, k, v) = _rec_inputs(N, T, Hh, HVv, K, V, seed=500 + T, dtype=torch.bfloat16)
    g, beta = _t(inp["g"]), _t(inp["beta"])
    P = N + 7
    pool_kv = torch.randn(P, HVv, K, V, device=DEV) * 0.5
    pool = pool_kv.clone() if layout == "kv" else _vk(pool_kv)
    perm = torch.randperm(P, generator=torch.Generator().manual_seed(T + N))[:N].to(torch.int32)
    perm[::9] = -1
    f = [to_f64(x) for x in (q, k, v, g, beta)]
    ro, rpool = R.recurrent(*f, to_f64(pool_kv), state_indices=perm.numpy())
    before = pool.clone()
    sd = (K, V) if layout == "kv" else (V, K)
    buf = torch.full((N, T, HVv) + sd, float("nan"), device=DEV) if T > 1 else None
    kw = dict(intermediate_states=buf) if T > 1 else {}
    o = flashqla.gdn_recurrent(q, k, v, g, beta, pool, state_indices=perm.to(DEV), state_layout=layout, **kw)
    assert_close("o", o, ro, TOL_BF16_OUT)
    got = pool if layout == "kv" else _vk(pool)
    assert_close("pool", got, rpool, TOL_BF16_OUT)
    pad = (perm < 0).nonzero().flatten().tolist()
    assert torch.count_nonzero(o[pad]) == 0, "padding sequences get o = 0"
    untouched = sorted(set(range(P)) - set(perm.tolist()))
    assert torch.equal(pool[untouched], before[untouched])
    if T > 1:
        live = [n for n in range(N) if perm[n] >= 0]
        assert torch.equal(buf[live, T - 1], pool[perm[live].long()]), "the last state is the pool's"
        assert torch.isnan(buf[pad]).all()


def test_cuda_recurrent_fused_gates_l2norm_varlen():
    seqlens = [3, 0, 1, 6]
    inp = make_inputs(1, 10, H, HV, K, V, seed=8, seqlens=seqlens, normalize_qk=False)
    a, b, A_log, dtb = _raw_gates(1, 10, 9)
    q, k, v = _qkv(inp)
    at, bt = _t(a, torch.bfloat16), _t(b, torch.bfloat16)
    pool = torch.randn(4, HV, K, V, device=DEV) * 0.5
    pool0 = to_f64(pool)
    g, beta = R.gates(to_f64(at), to_f64(bt), A_log=A_log, dt_bias=dtb, use_gate_in_kernel=True,
                      use_beta_sigmoid_in_kernel=True)
    f = [to_f64(x) for x in (q, k, v)]
    ro, rpool = R.recurrent(*f, g, beta, pool0, cu_seqlens=inp["cu_seqlens"], use_qk_l2norm=True)
    buf = torch.full((4, 6, HV, K, V), float("nan"), device=DEV)
    o = flashqla.gdn_recurrent(q, k, v, at, bt, pool, cu_seqlens=_t(inp["cu_seqlens"], torch.int32),
                               use_qk_l2norm=True, intermediate_states=buf, use_gate_in_kernel=True,
                               A_log=_t(A_log), dt_bias=_t(dtb), use_beta_sigmoid_in_kernel=True)
    assert_close("o", o, ro, TOL_BF16_OUT)
    assert_close("pool", pool, rpool, TOL_BF16_OUT)
    for n, L in enumerate(seqlens):
        if L:
            assert torch.isfinite(buf[n, :L]).all() and torch.isnan(buf[n, L:]).all()
            assert torch.equal(buf[n, L - 1], pool[n])
        else:
            assert torch.isnan(buf[n]).all()


def test_cuda_recurrent_sequence_longer_than_buffer_gives_nan():
    seqlens = [2, 5]
    inp = make_inputs(1, 7, H, HV, K, V, seed=10, seqlens=seqlens)
    args = _qkv(inp) + [_t(inp["g"]), _t(inp["beta"])]
    pool = torch.randn(2, HV, K, V, device=DEV)
    before = pool.clone()
    buf = torch.zeros((2, 4, HV, K, V), device=DEV)
    o = flashqla.gdn_recurrent(*args, pool, cu_seqlens=_t(inp["cu_seqlens"], torch.int64),
                               intermediate_states=buf)
    assert torch.isnan(o).all()              # cannot raise without a host sync: NaN, nothing written
    assert torch.equal(pool, before) and torch.all(buf == 0)


# --------------------------------------------------------------- commit ----

def test_cuda_commit_and_out_of_range_entries():
    N, Ti = 4, 3
    pool = torch.randn(6, HV, K, V, device=DEV)
    buf = torch.randn(N, Ti, HV, K, V, device=DEV)
    before = pool.clone()
    idx = torch.tensor([4, -1, 0, 9], device=DEV)        # 9 >= P: not checkable, skipped
    acc = torch.tensor([2, 3, 0, 1], device=DEV, dtype=torch.int32)
    flashqla.gdn_commit(pool, buf, idx, acc)
    torch.cuda.synchronize()
    assert torch.equal(pool[4], buf[0, 1])
    for s in (0, 1, 2, 3, 5):
        assert torch.equal(pool[s], before[s])
    flashqla.gdn_commit(pool, buf, torch.arange(N, device=DEV),
                        torch.tensor([0, 7, -1, 3], device=DEV))        # 7, -1: skipped
    torch.cuda.synchronize()
    assert torch.equal(pool[3], buf[3, 2])
    assert torch.equal(pool[1], before[1]) and torch.equal(pool[2], before[2])


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_cuda_graph_capture_verify_and_commit(layout):
    """A speculative-decoding step as a serving engine captures it: verify T
    draft tokens (intermediate states, pool untouched), then commit the
    accepted prefix; replayed with new inputs copied into the static buffers."""
    N, T, P = 8, 4, 12
    sd = (K, V) if layout == "kv" else (V, K)
    static = {n: torch.zeros(s, device=DEV, dtype=d) for n, s, d in (
        ("q", (N, T, H, K), torch.bfloat16), ("k", (N, T, H, K), torch.bfloat16),
        ("v", (N, T, HV, V), torch.bfloat16), ("g", (N, T, HV), torch.float32),
        ("beta", (N, T, HV), torch.float32))}
    idx = torch.zeros(N, dtype=torch.int32, device=DEV)
    acc = torch.zeros(N, dtype=torch.int32, device=DEV)
    pool = torch.zeros((P, HV) + sd, device=DEV)
    buf = torch.zeros((N, T, HV) + sd, device=DEV)

    def step():
        o = flashqla.gdn_recurrent(static["q"], static["k"], static["v"], static["g"],
                                   static["beta"], pool, state_indices=idx, intermediate_states=buf,
                                   update_state=False, state_layout=layout)
        flashqla.gdn_commit(pool, buf, idx, acc, state_layout=layout)
        return o

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()                                             # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_static = step()

    rng = np.random.default_rng(11)
    for rep in range(3):
        inp = make_inputs(N, T, H, HV, K, V, seed=20 + rep)
        for n in ("q", "k", "v"):
            static[n].copy_(_t(inp[n], torch.bfloat16))
        static["g"].copy_(_t(inp["g"]))
        static["beta"].copy_(_t(inp["beta"]))
        slots = rng.permutation(P)[:N].astype(np.int32)
        slots[rep] = -1
        idx.copy_(torch.as_tensor(slots))
        acc.copy_(torch.as_tensor(rng.integers(0, T + 1, N).astype(np.int32)))
        pool.copy_(torch.randn_like(pool))
        pool0, f = pool.clone(), [to_f64(static[n]) for n in ("q", "k", "v", "g", "beta")]
        graph.replay()
        torch.cuda.synchronize()
        pool_kv = pool0 if layout == "kv" else _vk(pool0)
        ro, _ = R.recurrent(*f, to_f64(pool_kv), state_indices=slots)
        assert_close("o", o_static, ro, TOL_BF16_OUT)
        h0 = np.stack([to_f64(pool_kv[i]) if i >= 0 else np.zeros((HV, K, V)) for i in slots])
        traj = R.states(*f, initial_state=h0)
        want = to_f64(pool_kv)
        for n, (sl, a) in enumerate(zip(slots, acc.cpu().tolist())):
            if sl >= 0 and a > 0:
                want[sl] = traj[n][a - 1]
        got = pool if layout == "kv" else _vk(pool)
        assert_close("pool after commit", got, want, TOL_BF16_OUT)
        for sl in set(range(P)) - {int(x) for x, a in zip(slots, acc.cpu().tolist()) if x >= 0 and a > 0}:
            assert torch.equal(pool[sl], pool0[sl])


def test_cuda_duplicate_slots_belong_to_the_first_sequence():
    """Without FLASHQLA_CHECK_INPUTS the CUDA backend cannot raise on duplicate
    state_indices (device memory): as in the recurrent step (issue 9), the
    slot belongs to its first sequence, later ones get NaN outputs and write
    nothing; the commit copies the first sequence's state."""
    seqlens = [70, 30, 50]
    inp = make_inputs(1, sum(seqlens), H, HV, K, V, seed=40, seqlens=seqlens, h0=False)
    args = _qkv(inp) + [_t(inp["g"]), _t(inp["beta"])]
    cu = _t(inp["cu_seqlens"], torch.int32)
    pool = torch.randn(4, HV, K, V, device=DEV)
    idx = torch.tensor([2, 1, 2], device=DEV, dtype=torch.int32)
    ref_pool = pool.clone()
    o_ref, _ = flashqla.gdn_chunk(*args, state=ref_pool, state_indices=torch.tensor(
        [2, 1, -1], device=DEV, dtype=torch.int32), cu_seqlens=cu)
    o, _ = flashqla.gdn_chunk(*args, state=pool, state_indices=idx, cu_seqlens=cu)
    torch.cuda.synchronize()
    assert torch.equal(o[:, :100], o_ref[:, :100])
    assert torch.isnan(o[:, 100:]).all()
    assert torch.equal(pool, ref_pool)
    buf = torch.randn(3, 2, HV, K, V, device=DEV)
    p2 = pool.clone()
    flashqla.gdn_commit(p2, buf, idx, torch.tensor([1, 2, 2], device=DEV))
    torch.cuda.synchronize()
    assert torch.equal(p2[2], buf[0, 0]) and torch.equal(p2[1], buf[1, 1])
    assert torch.equal(p2[0], pool[0]) and torch.equal(p2[3], pool[3])
