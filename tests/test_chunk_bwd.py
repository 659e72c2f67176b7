"""Chunked backward on the CPU backend: against the float64 reference's
gradients (NaN-poisoned gradient buffers, DESIGN §3 tolerances), and
torch.autograd.gradcheck in float64 through the public API (l2norm, g, beta
and the initial state included)."""

import pytest

torch = pytest.importorskip("torch")

import flashqla  # noqa: E402
from gdn_testing import (CPU_CASE_IDS, CPU_CASES, GRAD_NAMES, assert_close,  # noqa: E402
                         c_chunk_bwd, case_inputs, cast_inputs_torch, make_inputs,
                         reference_of, tolerance)


@pytest.mark.parametrize("case", CPU_CASES, ids=CPU_CASE_IDS)
def test_backward_matches_reference(case):
    name, sizes, opt = case
    inp, t = case_inputs(case)
    ref = reference_of(t, use_qk_l2norm=opt["l2norm"], scale=opt["scale"])
    d = c_chunk_bwd(t, scale=opt["scale"], use_qk_l2norm=opt["l2norm"])
    for gname in GRAD_NAMES:
        if gname == "dh0" and t["h0"] is None:
            assert d["dh0"] is None
            continue
        assert_close(gname, d[gname], ref[gname], tolerance(opt["dtype"], gname))


def _gradcheck_inputs(use_qk_l2norm, seqlens=None, B=1, T=70):
    # without the in-kernel l2norm, q and k come normalised (as in real models:
    # an unnormalised k makes the recurrence itself blow up)
    inp = make_inputs(B, T, 1, 2, 16, 16, seed=11, seqlens=seqlens,
                      normalize_qk=not use_qk_l2norm, a_max=4.0)
    # g <= 0 is checked on every call: leave the finite differences room (the
    # head without decay has g = 0 exactly)
    inp["g"] = inp["g"] - 1e-3
    t = cast_inputs_torch(inp, "float64", "float64")
    return [t[n].requires_grad_() for n in ("q", "k", "v", "g", "beta", "h0")], t["cu_seqlens"]


@pytest.mark.parametrize("use_qk_l2norm,fast_mode", [(False, True), (True, False)])
def test_gradcheck_fp64(use_qk_l2norm, fast_mode):
    """T = 70 crosses a chunk; GVA ratio 2; K = V = 16. The full Jacobian once
    (l2norm on, the path with every term), random projections otherwise."""
    args, _ = _gradcheck_inputs(use_qk_l2norm)

    def f(q, k, v, g, beta, h0):
        return flashqla.gdn_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                  use_qk_l2norm=use_qk_l2norm)

    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-7, rtol=1e-5,
                                    fast_mode=fast_mode)


def test_gradcheck_fp64_varlen():
    args, cu = _gradcheck_inputs(True, seqlens=[3, 66, 1])

    def f(q, k, v, g, beta, h0):
        return flashqla.gdn_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                  cu_seqlens=cu, use_qk_l2norm=True)

    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)
