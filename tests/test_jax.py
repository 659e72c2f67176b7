"""JAX interop on the CPU: flashqla.gdn_chunk / flashqla.jax on JAX arrays
return JAX arrays, jax.grad goes through the C backward (custom_vjp), the
recurrent step returns a new state, and traced calls fail clearly."""

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


def test_jax_jit_is_refused_clearly():
    j = _jnp(make_inputs(1, 8, 1, 1, 16, 16, seed=5))
    f = jax.jit(lambda q: flashqla.gdn_chunk(q, j["k"], j["v"], j["g"], j["beta"])[0])
    with pytest.raises(TypeError, match="concrete JAX arrays"):
        f(j["q"])


def test_jax_recurrent_returns_new_state():
    inp = make_inputs(3, 2, 1, 2, 16, 16, seed=6, h0=False)
    j = _jnp(inp)
    pool = jnp.asarray(np.random.default_rng(0).standard_normal((4, 2, 16, 16)), jnp.float32)
    before = np.array(pool)
    idx = jnp.asarray([2, -1, 0], jnp.int32)
    o, new = fqj.gdn_recurrent(j["q"], j["k"], j["v"], j["g"], j["beta"], pool,
                               state_indices=idx)
    assert isinstance(o, jax.Array) and isinstance(new, jax.Array)
    np.testing.assert_array_equal(np.array(pool), before)  # the input is left as it was
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
