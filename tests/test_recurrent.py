"""Recurrent step (decode / multi-token verify) on the CPU backend: against
the reference, pool semantics (state_indices incl. -1 padding, int32/int64),
in-place update, and agreement with the chunked forward on the same tokens."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashqla  # noqa: E402
from flashqla import reference  # noqa: E402
from gdn_testing import (assert_close, cast_inputs_torch, make_inputs, to_f64,  # noqa: E402
                         tolerance)


def _pool(P, HV, K, V, dtype=torch.float32, seed=0):
    rng = np.random.default_rng(seed)
    return torch.tensor(rng.standard_normal((P, HV, K, V)) * 0.5, dtype=dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("use_qk_l2norm", [False, True])
def test_recurrent_matches_reference(dtype, T, index_dtype, use_qk_l2norm):
    N, H, HV, K, V, P = 5, 2, 4, 32, 32, 8
    inp = make_inputs(N, T, H, HV, K, V, seed=T, h0=False, normalize_qk=not use_qk_l2norm)
    t = cast_inputs_torch(inp, dtype, "float32")
    sdt = torch.float64 if dtype == "float64" else torch.float32
    pool = _pool(P, HV, K, V, sdt)
    before = pool.clone()
    idx = torch.tensor([6, -1, 0, 3, -1], dtype=index_dtype)
    o_ref, pool_ref = reference.recurrent(*(to_f64(t[n]) for n in ("q", "k", "v", "g", "beta")),
                                          to_f64(pool), state_indices=idx.numpy(),
                                          use_qk_l2norm=use_qk_l2norm)
    o = flashqla.gdn_recurrent(t["q"], t["k"], t["v"], t["g"], t["beta"], pool,
                               state_indices=idx, use_qk_l2norm=use_qk_l2norm)
    assert isinstance(o, torch.Tensor) and o.dtype == t["q"].dtype
    tol = tolerance(dtype, "o")
    live = [0, 2, 3]
    assert_close("o", o[live], o_ref[live], tol)
    assert torch.count_nonzero(o[[1, 4]]) == 0, "padded sequences must get o = 0"
    assert_close("state (used slots)", pool[[6, 0, 3]], pool_ref[[6, 0, 3]], tol)
    for s in (1, 2, 4, 5, 7):
        assert torch.equal(pool[s], before[s]), f"slot {s} is not used and must not change"


def test_recurrent_without_indices_and_varlen():
    seqlens = [2, 0, 3, 1]
    inp = make_inputs(1, 6, 1, 2, 16, 16, seed=3, seqlens=seqlens, h0=False)
    t = cast_inputs_torch(inp, "float32")
    pool = _pool(4, 2, 16, 16)
    o_ref, pool_ref = reference.recurrent(*(inp[n] for n in ("q", "k", "v", "g", "beta")),
                                          to_f64(pool), cu_seqlens=inp["cu_seqlens"])
    o = flashqla.gdn_recurrent(t["q"], t["k"], t["v"], t["g"], t["beta"], pool,
                               cu_seqlens=t["cu_seqlens"].to(torch.int32))
    assert_close("o", o, o_ref, tolerance("float32", "o"))
    assert_close("state", pool, pool_ref, tolerance("float32", "ht"))


def test_recurrent_numpy_in_place():
    inp = make_inputs(3, 1, 1, 2, 16, 16, seed=4, h0=False)
    pool = np.random.default_rng(1).standard_normal((3, 2, 16, 16)).astype(np.float32)
    o_ref, pool_ref = reference.recurrent(*(inp[n] for n in ("q", "k", "v", "g", "beta")), pool)
    args = [inp[n].astype(np.float32) for n in ("q", "k", "v", "g", "beta")]
    o = flashqla.gdn_recurrent(*args, pool)
    assert isinstance(o, np.ndarray) and o.dtype == np.float32
    assert_close("o", o, o_ref, tolerance("float32", "o"))
    assert_close("state", pool, pool_ref, tolerance("float32", "ht"))


@pytest.mark.parametrize("T", [1, 4, 70])
def test_recurrent_equals_chunked_forward(T):
    """Decoding token by token (or 4 at a time) gives the chunked forward's
    outputs and final state."""
    B, H, HV, K, V = 2, 2, 4, 32, 32
    inp = make_inputs(B, T, H, HV, K, V, seed=8)
    t = cast_inputs_torch(inp, "float32")
    o_chunk, ht_chunk = flashqla.gdn_chunk(t["q"], t["k"], t["v"], t["g"], t["beta"],
                                           initial_state=t["h0"], output_final_state=True)
    pool = t["h0"].clone()
    step = 1 if T == 70 else T
    outs = []
    for s in range(0, T, step):
        sl = slice(s, s + step)
        outs.append(flashqla.gdn_recurrent(t["q"][:, sl], t["k"][:, sl], t["v"][:, sl],
                                           t["g"][:, sl], t["beta"][:, sl], pool))
    o_rec = torch.cat(outs, dim=1)
    tol = tolerance("float32", "o")
    assert_close("o (recurrent vs chunked)", o_rec, o_chunk.double().numpy(), tol)
    assert_close("state (recurrent vs chunked)", pool, ht_chunk.double().numpy(), tol)


def test_recurrent_writes_every_output_element():
    """Through _C with a NaN-poisoned o: live rows are finite and right,
    padded rows are written as exactly 0."""
    from flashqla import _C
    inp = make_inputs(4, 3, 1, 2, 16, 16, seed=9, h0=False)
    t = cast_inputs_torch(inp, "float32")
    pool = _pool(3, 2, 16, 16)
    before = pool.clone()
    idx = torch.tensor([2, -1, 0, -1], dtype=torch.int64)
    o = torch.full_like(t["v"], float("nan"))
    _C.recurrent(t["q"], t["k"], t["v"], t["g"], t["beta"], pool, o, scale=16 ** -0.5,
                 state_indices=idx)
    o_ref, pool_ref = reference.recurrent(*(inp[n] for n in ("q", "k", "v", "g", "beta")),
                                          to_f64(before), state_indices=idx.numpy())
    assert torch.equal(o[[1, 3]], torch.zeros_like(o[[1, 3]]))
    assert_close("o", o[[0, 2]], o_ref[[0, 2]], tolerance("float32", "o"))
    assert_close("state", pool, pool_ref, tolerance("float32", "ht"))
