"""JAX on the CPU: flashqla.jax's XLA custom calls (the XLA FFI handlers of
csrc/xla) under eager calls, jax.jit, jax.grad (custom_vjp through the C
backward), jax.vmap, jax.checkpoint and lax.scan; the recurrent step returns
the new pool, aliased to the old one (in place when donated). Every result
against the float64 reference. The GPU variants are in test_jax_gpu below
(marked gpu)."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import flashqla  # noqa: E402
import flashqla.jax as fqj  # noqa: E402
from flashqla import reference  # noqa: E402
from gdn_testing import (GRAD_NAMES, assert_close, make_inputs, reference_of,  # noqa: E402
                         tolerance)

TOL32 = tolerance("float32", "o")


def _jnp(inp, dtype=jnp.float32):
    return {n: None if x is None else
            (jnp.asarray(x, dtype=jnp.int32) if n == "cu_seqlens" else jnp.asarray(x, dtype=dtype))
            for n, x in inp.items()}


def test_jax_forward_returns_jax_arrays():
    inp = make_inputs(1, 100, 2, 4, 16, 16, seed=1, seqlens=[1, 35, 64])
    j = _jnp(inp)
    for fn in (flashqla.gdn_chunk, fqj.gdn_chunk):
        o, ht = fn(j["q"], j["k"], j["v"], j["g"], j["beta"], initial_state=j["h0"],
                   output_final_state=True, cu_seqlens=j["cu_seqlens"])
        assert isinstance(o, jax.Array) and o.dtype == jnp.float32 and o.shape == (1, 100, 4, 16)
        assert isinstance(ht, jax.Array) and ht.dtype == jnp.float32
        ref = reference_of(j, grads=False)
        assert_close("o", o, ref["o"], TOL32)
        assert_close("final_state", ht, ref["ht"], TOL32)


def test_jax_bfloat16():
    inp = make_inputs(2, 70, 1, 2, 32, 32, seed=2)
    j = _jnp(inp, jnp.bfloat16)
    j["g"], j["beta"], j["h0"] = (jnp.asarray(inp[n], jnp.float32) for n in ("g", "beta", "h0"))
    o, ht = flashqla.gdn_chunk(j["q"], j["k"], j["v"], j["g"], j["beta"], initial_state=j["h0"],
                               output_final_state=True)
    assert o.dtype == jnp.bfloat16 and ht.dtype == jnp.float32
    ref = reference_of(j, grads=False)
    assert_close("o", o, ref["o"], tolerance("bfloat16", "o"))
    assert_close("final_state", ht, ref["ht"], tolerance("bfloat16", "ht"))


@pytest.mark.parametrize("use_qk_l2norm", [False, True])
def test_jax_grad_matches_reference(use_qk_l2norm):
    inp = make_inputs(1, 90, 1, 2, 16, 16, seed=3, dht=True, seqlens=[20, 70],
                      normalize_qk=not use_qk_l2norm)
    j = _jnp(inp)

    def loss(q, k, v, g, beta, h0):
        o, ht = flashqla.gdn_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                   cu_seqlens=j["cu_seqlens"], use_qk_l2norm=use_qk_l2norm)
        return jnp.sum(o * j["do"]) + jnp.sum(ht * j["dht"])

    names = ("q", "k", "v", "g", "beta", "h0")
    grads = jax.grad(loss, argnums=tuple(range(6)))(*(j[n] for n in names))
    ref = reference_of(j, use_qk_l2norm=use_qk_l2norm)
    for name, g in zip(GRAD_NAMES, grads):
        assert isinstance(g, jax.Array) and g.dtype == jnp.float32
        assert_close(name, g, ref[name], TOL32)


def test_jax_grad_casts_gate_gradients_back_and_no_initial_state():
    inp = make_inputs(1, 40, 1, 2, 16, 16, seed=4, h0=False)
    j = _jnp(inp)
    g16 = j["g"].astype(jnp.bfloat16)

    def loss(q, g):
        return jnp.sum(fqj.gdn_chunk(q, j["k"], j["v"], g, j["beta"])[0] * j["do"])

    dq, dg = jax.grad(loss, argnums=(0, 1))(j["q"], g16)
    assert dg.dtype == jnp.bfloat16 and dq.dtype == jnp.float32
    ref = reference_of(dict(j, g=g16))
    assert_close("dq", dq, ref["dq"], TOL32)
    assert_close("dg", dg, ref["dg"], tolerance("bfloat16", "dg"))


def test_jax_recurrent_returns_new_state():
    inp = make_inputs(3, 2, 1, 2, 16, 16, seed=6, h0=False)
    j = _jnp(inp)
    pool = jnp.asarray(np.random.default_rng(0).standard_normal((4, 2, 16, 16)), jnp.float32)
    before = np.array(pool)
    idx = jnp.asarray([2, -1, 0], jnp.int32)
    o, new = fqj.gdn_recurrent(j["q"], j["k"], j["v"], j["g"], j["beta"], pool,
                               state_indices=idx)
    assert isinstance(o, jax.Array) and isinstance(new, jax.Array)
    np.testing.assert_array_equal(np.array(pool), before)  # not donated: left as it was
    o_ref, pool_ref = reference.recurrent(*(inp[n] for n in ("q", "k", "v", "g", "beta")),
                                          before, state_indices=[2, -1, 0])
    assert_close("o", o, o_ref, TOL32)
    assert_close("new_state", new, pool_ref, TOL32)
    with pytest.raises(TypeError, match="flashqla.jax.gdn_recurrent"):
        flashqla.gdn_recurrent(j["q"], j["k"], j["v"], j["g"], j["beta"], pool,
                               state_indices=idx)


def test_jax_bad_input_raises():
    j = _jnp(make_inputs(1, 8, 2, 4, 16, 16, seed=7))
    with pytest.raises(ValueError, match="k"):
        flashqla.gdn_chunk(j["q"], j["k"][:, :, :1], j["v"], j["g"], j["beta"])
    with pytest.raises(TypeError, match="k"):
        flashqla.gdn_chunk(j["q"], np.asarray(j["k"]), j["v"], j["g"], j["beta"])


# ------------------------------------------------ transformations (XLA FFI) ----

def _chunk_loss(j, use_qk_l2norm=False, cu=None):
    def loss(q, k, v, g, beta, h0):
        o, ht = fqj.gdn_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                              cu_seqlens=cu, use_qk_l2norm=use_qk_l2norm)
        return jnp.sum(o * j["do"]) + jnp.sum(ht * j["dht"])
    return loss


NAMES = ("q", "k", "v", "g", "beta", "h0")


def test_jit_forward_and_grad():
    inp = make_inputs(1, 130, 2, 4, 16, 16, seed=11, seqlens=[1, 64, 65], dht=True)
    j = _jnp(inp)
    fwd = jax.jit(lambda *a: fqj.gdn_chunk(*a[:5], initial_state=a[5], output_final_state=True,
                                           cu_seqlens=j["cu_seqlens"]))
    o, ht = fwd(*(j[n] for n in NAMES))
    ref = reference_of(j)
    assert_close("o", o, ref["o"], TOL32)
    assert_close("final_state", ht, ref["ht"], TOL32)
    grads = jax.jit(jax.grad(_chunk_loss(j, cu=j["cu_seqlens"]), argnums=tuple(range(6))))(
        *(j[n] for n in NAMES))
    for name, g in zip(GRAD_NAMES, grads):
        assert_close(name, g, ref[name], TOL32)
    # the custom calls are in the program: forward and backward for value_and_grad,
    # the backward alone for grad (it recomputes from the inputs: no forward needed)
    both = jax.jit(jax.value_and_grad(_chunk_loss(j, cu=j["cu_seqlens"]))).lower(
        *(j[n] for n in NAMES)).as_text()
    assert "flashqla_chunk_fwd" in both and "flashqla_chunk_bwd" in both
    only = jax.jit(jax.grad(_chunk_loss(j, cu=j["cu_seqlens"]))).lower(
        *(j[n] for n in NAMES)).as_text()
    assert "flashqla_chunk_bwd" in only


def test_jit_cu_seqlens_as_traced_argument():
    inp = make_inputs(1, 100, 1, 2, 16, 16, seed=12, seqlens=[30, 70])
    j = _jnp(inp)
    f = jax.jit(lambda q, cu: fqj.gdn_chunk(q, j["k"], j["v"], j["g"], j["beta"],
                                            initial_state=j["h0"], cu_seqlens=cu)[0])
    assert_close("o", f(j["q"], j["cu_seqlens"]), reference_of(j, grads=False)["o"], TOL32)


@pytest.mark.parametrize("in_axes", [0, (0, None, 0, None, 0, 0)])
def test_vmap_over_a_leading_axis(in_axes):
    """vmap folds the mapped axis into B (broadcast_all batching of the custom call)."""
    inps = [make_inputs(2, 70, 1, 2, 16, 16, seed=20 + i, dht=True) for i in range(3)]
    js = [_jnp(x) for x in inps]
    if in_axes != 0:  # k and g shared by every member of the batch
        for j in js[1:]:
            j["k"], j["g"] = js[0]["k"], js[0]["g"]
    stack = {n: jnp.stack([j[n] for j in js]) for n in NAMES}
    args = [stack[n] if (in_axes == 0 or in_axes[i] == 0) else js[0][n]
            for i, n in enumerate(NAMES)]
    f = jax.vmap(lambda q, k, v, g, beta, h0: fqj.gdn_chunk(
        q, k, v, g, beta, initial_state=h0, output_final_state=True), in_axes=in_axes)
    o, ht = jax.jit(f)(*args)
    assert o.shape == (3, 2, 70, 2, 16) and ht.shape == (3, 2, 2, 16, 16)
    for i, j in enumerate(js):
        ref = reference_of(j, grads=False)
        assert_close(f"o[{i}]", o[i], ref["o"], TOL32)
        assert_close(f"final_state[{i}]", ht[i], ref["ht"], TOL32)
    # and its gradient (the backward custom call, batched the same way)
    dq = jax.grad(lambda q: jnp.sum(f(q, *args[1:])[0] * jnp.stack([j["do"] for j in js])))(
        args[0])
    for i, j in enumerate(js):
        assert_close(f"dq[{i}]", dq[i], reference_of(j)["dq"], TOL32)


def test_vmap_with_cu_seqlens_runs_sequentially():
    inps = [make_inputs(1, 50, 1, 2, 16, 16, seed=30 + i, seqlens=[20, 30]) for i in range(2)]
    js = [_jnp(x) for x in inps]
    stack = {n: jnp.stack([j[n] for j in js]) for n in NAMES}
    f = jax.vmap(lambda q, k, v, g, beta, h0: fqj.gdn_chunk(
        q, k, v, g, beta, initial_state=h0, cu_seqlens=js[0]["cu_seqlens"])[0])
    o = f(*(stack[n] for n in NAMES))
    for i, j in enumerate(js):
        assert_close(f"o[{i}]", o[i], reference_of(j, grads=False)["o"], TOL32)


def test_checkpoint_and_scan_over_layers():
    """Two 'layers' in a lax.scan, each under jax.checkpoint, differentiated: the
    value and the gradients against the float64 reference chained by hand."""
    inps = [make_inputs(1, 64, 1, 2, 16, 16, seed=40 + i, h0=False) for i in range(2)]
    js = [_jnp(x) for x in inps]
    ks = jnp.stack([j["k"] for j in js])
    v, g, beta = js[0]["v"], js[0]["g"], js[0]["beta"]

    @jax.checkpoint
    def layer(x, k):
        return fqj.gdn_chunk(x, k, v, g, beta)[0]          # [1, 64, 2, 16]

    def model(q, ks):
        def body(x, k):
            o = layer(x, k)
            return o[:, :, :1], jnp.sum(o)                 # head 0 is the next layer's q
        return jnp.sum(jax.lax.scan(body, q, ks)[1])

    val, (dq, dks) = jax.jit(jax.value_and_grad(model, argnums=(0, 1)))(js[0]["q"], ks)
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    x0, k0, k1, v_, g_, b_ = (f64(x) for x in (js[0]["q"], ks[0], ks[1], v, g, beta))
    o1 = reference.forward(x0, k0, v_, g_, b_)[0]
    x1 = np.ascontiguousarray(o1[:, :, :1])
    o2 = reference.forward(x1, k1, v_, g_, b_)[0]
    assert abs(float(val) - (o1.sum() + o2.sum())) <= TOL32 * (abs(o1).sum() + abs(o2).sum())
    dq2, dk2 = reference.backward(x1, k1, v_, g_, b_, np.ones(o2.shape))[:2]
    do1 = np.ones(o1.shape)
    do1[:, :, :1] += dq2
    dq1, dk1 = reference.backward(x0, k0, v_, g_, b_, do1)[:2]
    assert_close("dq (scan + checkpoint)", dq, dq1, TOL32)
    assert_close("dk layer 1", dks[0], dk1, TOL32)
    assert_close("dk layer 2", dks[1], dk2, TOL32)


def test_recurrent_under_jit_donated_pool_is_updated_in_place():
    inp = make_inputs(3, 1, 1, 2, 16, 16, seed=50, h0=False)
    j = _jnp(inp)
    pool0 = np.random.default_rng(1).standard_normal((5, 2, 16, 16)).astype(np.float32)
    idx = jnp.asarray([4, -1, 1], jnp.int32)

    def step(pool, q, k, v, g, beta):
        o, pool = fqj.gdn_recurrent(q, k, v, g, beta, pool, state_indices=idx)
        return pool, o

    jstep = jax.jit(step, donate_argnums=0)
    args = [j[n] for n in ("q", "k", "v", "g", "beta")]
    compiled = jstep.lower(jnp.asarray(pool0), *args).compile().as_text()
    assert "flashqla_recurrent" in compiled
    assert not [line for line in compiled.splitlines() if " copy(" in line and "f32[5,2,16,16]" in line], \
        "the donated pool is copied"
    pool = jnp.asarray(pool0)
    ptr = pool.unsafe_buffer_pointer()
    new_pool, o = jstep(pool, *args)
    assert pool.is_deleted()                         # donated
    assert new_pool.unsafe_buffer_pointer() == ptr   # the same buffer, updated in place
    o_ref, pool_ref = reference.recurrent(*(inp[n] for n in ("q", "k", "v", "g", "beta")),
                                          pool0, state_indices=[4, -1, 1])
    assert_close("o", o, o_ref, TOL32)
    assert_close("pool", new_pool, pool_ref, TOL32)


def test_recurrent_decode_loop_in_scan():
    """lax.scan over decode steps carrying the pool (the serving loop)."""
    T = 5
    inp = make_inputs(2, T, 1, 2, 16, 16, seed=51, h0=False)
    j = _jnp(inp)
    pool0 = jnp.asarray(np.random.default_rng(2).standard_normal((3, 2, 16, 16)), jnp.float32)
    idx = jnp.asarray([2, 0], jnp.int32)
    xs = tuple(jnp.moveaxis(j[n], 1, 0)[:, :, None] for n in ("q", "k", "v", "g", "beta"))

    def body(pool, x):
        o, pool = fqj.gdn_recurrent(*x, pool, state_indices=idx)
        return pool, o[:, 0]

    run = jax.jit(lambda p: jax.lax.scan(body, p, xs), donate_argnums=0)
    compiled = run.lower(pool0).compile().as_text()
    assert not [line for line in compiled.splitlines()
                if " copy(" in line and "f32[3,2,16,16]" in line], "the carried pool is copied"
    donated = pool0 + 0
    ptr = donated.unsafe_buffer_pointer()
    pool, os = run(donated)
    assert donated.is_deleted() and pool.unsafe_buffer_pointer() == ptr  # one buffer throughout
    o_ref, pool_ref = reference.recurrent(*(inp[n] for n in ("q", "k", "v", "g", "beta")),
                                          np.asarray(pool0), state_indices=[2, 0])
    assert_close("o", jnp.moveaxis(os, 0, 1), o_ref, TOL32)
    assert_close("pool", pool, pool_ref, TOL32)


def test_recurrent_vmap_over_independent_pools():
    inps = [make_inputs(2, 1, 1, 2, 16, 16, seed=60 + i, h0=False) for i in range(2)]
    js = [_jnp(x) for x in inps]
    pools = np.random.default_rng(3).standard_normal((2, 2, 2, 16, 16)).astype(np.float32)
    stack = {n: jnp.stack([j[n] for j in js]) for n in ("q", "k", "v", "g", "beta")}
    f = jax.vmap(lambda q, k, v, g, beta, p: fqj.gdn_recurrent(q, k, v, g, beta, p))
    o, new = jax.jit(f)(*(stack[n] for n in ("q", "k", "v", "g", "beta")), jnp.asarray(pools))
    for i, x in enumerate(inps):
        o_ref, p_ref = reference.recurrent(*(x[n] for n in ("q", "k", "v", "g", "beta")), pools[i])
        assert_close(f"o[{i}]", o[i], o_ref, TOL32)
        assert_close(f"pool[{i}]", new[i], p_ref, TOL32)


def test_fwd_bwd_pair_on_jax_arrays():
    inp = make_inputs(1, 60, 1, 2, 16, 16, seed=70, dht=True)
    j = _jnp(inp)
    o, ht, ctx = flashqla.gdn_chunk_fwd(j["q"], j["k"], j["v"], j["g"], j["beta"],
                                        initial_state=j["h0"], output_final_state=True)
    assert isinstance(ctx, flashqla.ChunkContext) and "jax" in repr(ctx)
    grads = flashqla.gdn_chunk_bwd(ctx, j["do"], j["dht"])
    ref = reference_of(j)
    assert_close("o", o, ref["o"], TOL32)
    for name, g in zip(GRAD_NAMES, grads):
        assert isinstance(g, jax.Array)
        assert_close(name, g, ref[name], TOL32)


def test_trace_time_errors_name_the_argument():
    j = _jnp(make_inputs(1, 8, 2, 4, 16, 16, seed=71))
    with pytest.raises(ValueError, match="^v: the value heads HV=3"):
        jax.jit(lambda v: fqj.gdn_chunk(j["q"], j["k"], v, j["g"], j["beta"]))(j["v"][:, :, :3])
    with pytest.raises(ValueError, match="^initial_state: expected shape"):
        fqj.gdn_chunk(j["q"], j["k"], j["v"], j["g"], j["beta"], initial_state=j["h0"][:, :1])
    with pytest.raises(TypeError, match="^state: expected dtype float32"):
        fqj.gdn_recurrent(j["q"], j["k"], j["v"], j["g"], j["beta"],
                          jnp.zeros((1, 4, 16, 16), jnp.bfloat16))
    with pytest.raises(ValueError, match="^cu_seqlens: packed sequences need q of batch size 1"):
        q2 = jnp.concatenate([j["q"]] * 2)
        fqj.gdn_chunk(q2, q2, jnp.concatenate([j["v"]] * 2), jnp.concatenate([j["g"]] * 2),
                      jnp.concatenate([j["beta"]] * 2), cu_seqlens=[0, 8])


def test_runtime_errors_carry_flashqla_message():
    """What only the values show (here cu_seqlens not ending at T) fails the computation."""
    j = _jnp(make_inputs(1, 8, 1, 2, 16, 16, seed=72))
    with pytest.raises(Exception, match="cu_seqlens"):
        jax.block_until_ready(fqj.gdn_chunk(j["q"], j["k"], j["v"], j["g"], j["beta"],
                                            cu_seqlens=[0, 3, 7])[0])


# -------------------------------------------------------------------- GPU ----

def _gpu_device():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        return None


@pytest.mark.gpu
def test_jax_gpu_jit_grad_vmap_scan_and_donation():
    dev = _gpu_device()
    if dev is None:
        pytest.skip("JAX has no GPU backend here (jax[cuda] not installed)")
    inp = make_inputs(1, 300, 2, 4, 128, 128, seed=80, seqlens=[100, 200], dht=True)
    j = {n: None if x is None else jax.device_put(x, dev)
         for n, x in _jnp(inp, jnp.bfloat16).items()}
    for n in ("g", "beta", "h0", "dht"):
        j[n] = j[n].astype(jnp.float32)
    j["cu_seqlens"] = jax.device_put(jnp.asarray(inp["cu_seqlens"], jnp.int32), dev)
    loss = _chunk_loss(j, cu=j["cu_seqlens"])
    grads = jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*(j[n] for n in NAMES))
    ref = reference_of(j)
    for name, g in zip(GRAD_NAMES, grads):
        assert g.devices() == {dev}
        assert_close(name, g, ref[name], tolerance("bfloat16", name))
    # vmap (folded into B), under jit
    b = _jnp(make_inputs(2, 200, 2, 4, 128, 128, seed=81), jnp.bfloat16)
    b = {n: None if x is None else jax.device_put(x, dev) for n, x in b.items()}
    b["g"], b["beta"], b["h0"] = (b[n].astype(jnp.float32) for n in ("g", "beta", "h0"))
    f = jax.jit(jax.vmap(lambda q, h0: fqj.gdn_chunk(q, b["k"], b["v"], b["g"], b["beta"],
                                                      initial_state=h0)[0]))
    o = f(jnp.stack([b["q"], b["q"]]), jnp.stack([b["h0"], b["h0"] * 0]))
    assert_close("vmap o[0]", o[0], reference_of(b, grads=False)["o"], tolerance("bfloat16", "o"))
    assert_close("vmap o[1]", o[1], reference_of(dict(b, h0=np.zeros(b["h0"].shape)),
                                                 grads=False)["o"], tolerance("bfloat16", "o"))
    # decode loop: scan over steps, pool donated and updated in place
    dec = make_inputs(4, 3, 2, 4, 128, 128, seed=82, h0=False)
    d = {n: None if x is None else jax.device_put(x, dev) for n, x in _jnp(dec, jnp.bfloat16).items()}
    d["g"], d["beta"] = d["g"].astype(jnp.float32), d["beta"].astype(jnp.float32)
    pool0 = np.random.default_rng(4).standard_normal((5, 4, 128, 128)).astype(np.float32)
    idx = jax.device_put(jnp.asarray([4, 0, -1, 2], jnp.int32), dev)
    xs = tuple(jnp.moveaxis(d[n], 1, 0)[:, :, None] for n in ("q", "k", "v", "g", "beta"))

    def body(pool, x):
        o, pool = fqj.gdn_recurrent(*x, pool, state_indices=idx)
        return pool, o[:, 0]

    run = jax.jit(lambda p: jax.lax.scan(body, p, xs), donate_argnums=0)
    pool = jax.device_put(jnp.asarray(pool0), dev)
    ptr = pool.unsafe_buffer_pointer()
    new_pool, os = run(pool)
    assert pool.is_deleted() and new_pool.unsafe_buffer_pointer() == ptr
    o_ref, pool_ref = reference.recurrent(*(to_f64_(d[n]) for n in ("q", "k", "v", "g", "beta")),
                                          pool0, state_indices=[4, 0, -1, 2])
    assert_close("decode o", jnp.moveaxis(os, 0, 1), o_ref, tolerance("bfloat16", "o"))
    assert_close("decode pool", new_pool, pool_ref, tolerance("bfloat16", "ht"))


def to_f64_(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def test_a_build_without_handlers_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(fqj._C, "xla_ffi_targets", lambda: [])
    fqj._registered.cache_clear()
    try:
        j = _jnp(make_inputs(1, 8, 1, 1, 16, 16, seed=73))
        with pytest.raises(flashqla.Error, match="no XLA FFI handlers.*FLASHQLA_NO_XLA_FFI"):
            fqj.gdn_chunk(j["q"], j["k"], j["v"], j["g"], j["beta"])
    finally:
        monkeypatch.undo()
        fqj._registered.cache_clear()
    assert "cpu" in fqj._registered()
    assert flashqla._C.xla_ffi_api_version().startswith("0.")
