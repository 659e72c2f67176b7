"""The float64 reference (flashqla.reference) checked on its own: its
hand-written backward against central finite differences and against PyTorch
autograd through an independent float64 torch recurrence; its recurrent step
against its forward."""

import numpy as np
import pytest

from flashqla import reference
from gdn_testing import GRAD_NAMES, make_inputs, reference_of

FD_TOL = 1e-6          # central differences, step 1e-6, float64
AUTOGRAD_TOL = 1e-11   # two float64 evaluations of the same function


def _loss(inp, use_qk_l2norm, scale=None):
    o, ht = reference.forward(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                              scale=scale, initial_state=inp["h0"],
                              cu_seqlens=inp["cu_seqlens"], use_qk_l2norm=use_qk_l2norm)
    return float(np.sum(o * inp["do"]) + np.sum(ht * inp["dht"]))


@pytest.mark.parametrize("use_qk_l2norm", [False, True])
@pytest.mark.parametrize("varlen", [False, True])
def test_backward_matches_finite_differences(use_qk_l2norm, varlen):
    if varlen:
        inp = make_inputs(1, 7, 1, 2, 3, 2, seed=1, seqlens=[3, 0, 1, 3], dht=True, a_max=2.0,
                          normalize_qk=not use_qk_l2norm)
    else:
        inp = make_inputs(2, 5, 1, 2, 3, 2, seed=2, dht=True, a_max=2.0,
                          normalize_qk=not use_qk_l2norm)
    grads = reference_of(inp, use_qk_l2norm=use_qk_l2norm)
    eps = 1e-6
    for name, gname in zip(("q", "k", "v", "g", "beta", "h0"), GRAD_NAMES):
        x = inp[name]
        fd = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            old = x[idx]
            x[idx] = old + eps
            lp = _loss(inp, use_qk_l2norm)
            x[idx] = old - eps
            lm = _loss(inp, use_qk_l2norm)
            x[idx] = old
            fd[idx] = (lp - lm) / (2 * eps)
        err = np.linalg.norm(grads[gname] - fd) / np.linalg.norm(fd)
        assert err < FD_TOL, f"{gname}: rel error vs finite differences {err:.2e}"


def _torch_recurrence(q, k, v, g, beta, h0, cu, scale, use_qk_l2norm):
    """Independent float64 torch version of DESIGN §1 (autograd does the rest)."""
    import torch
    if use_qk_l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + reference.L2NORM_EPS)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + reference.L2NORM_EPS)
    HV, H = v.shape[2], q.shape[2]
    q = q.repeat_interleave(HV // H, dim=2)
    k = k.repeat_interleave(HV // H, dim=2)
    outs, finals = [], []
    for n in range(len(cu) - 1):
        S = h0[n]
        for t in range(int(cu[n]), int(cu[n + 1])):
            S = torch.exp(g[0, t])[:, None, None] * S
            u = beta[0, t][:, None] * (v[0, t] - torch.einsum("hkv,hk->hv", S, k[0, t]))
            S = S + k[0, t][:, :, None] * u[:, None, :]
            outs.append(scale * torch.einsum("hkv,hk->hv", S, q[0, t]))
        finals.append(S)
    return torch.stack(outs)[None], torch.stack(finals)


@pytest.mark.parametrize("use_qk_l2norm", [False, True])
def test_backward_matches_torch_autograd(use_qk_l2norm):
    torch = pytest.importorskip("torch")
    # 150 tokens: crosses the reference's 64-token checkpoints; GVA ratio 2
    seqlens = [150, 1, 0, 40]
    inp = make_inputs(1, sum(seqlens), 2, 4, 8, 6, seed=3, seqlens=seqlens, dht=True,
                      normalize_qk=not use_qk_l2norm)
    scale = 0.37
    grads = reference_of(inp, use_qk_l2norm=use_qk_l2norm, scale=scale)
    names = ("q", "k", "v", "g", "beta", "h0")
    t = {n: torch.tensor(inp[n], dtype=torch.float64, requires_grad=True) for n in names}
    o, ht = _torch_recurrence(t["q"], t["k"], t["v"], t["g"], t["beta"], t["h0"],
                              inp["cu_seqlens"], scale, use_qk_l2norm)
    np.testing.assert_allclose(o.detach().numpy(), grads["o"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(ht.detach().numpy(), grads["ht"], rtol=0, atol=1e-12)
    loss = (o * torch.tensor(inp["do"])).sum() + (ht * torch.tensor(inp["dht"])).sum()
    loss.backward()
    for n, gname in zip(names, GRAD_NAMES):
        ref = t[n].grad.numpy()
        err = np.linalg.norm(grads[gname] - ref) / np.linalg.norm(ref)
        assert err < AUTOGRAD_TOL, f"{gname}: rel error vs torch autograd {err:.2e}"


def test_recurrent_pool_semantics():
    inp = make_inputs(1, 5, 1, 2, 4, 3, seed=4, seqlens=[2, 1, 2], h0=False)
    rng = np.random.default_rng(0)
    pool = rng.standard_normal((4, 2, 4, 3))
    idx = np.array([3, -1, 0])
    o, new = reference.recurrent(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool,
                                 state_indices=idx, cu_seqlens=inp["cu_seqlens"])
    o_ref, ht = reference.forward(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                                  initial_state=pool[[3, 0, 0]], cu_seqlens=inp["cu_seqlens"])
    np.testing.assert_array_equal(o[0, 2], 0.0)           # padded sequence: o rows zero
    np.testing.assert_allclose(o[0, :2], o_ref[0, :2], rtol=1e-14)
    np.testing.assert_allclose(o[0, 3:], o_ref[0, 3:], rtol=1e-14)
    np.testing.assert_allclose(new[3], ht[0], rtol=1e-14)
    np.testing.assert_allclose(new[0], ht[2], rtol=1e-14)
    np.testing.assert_array_equal(new[1], pool[1])         # untouched slots
    np.testing.assert_array_equal(new[2], pool[2])


def test_tolerance_table_is_design_section_3():
    tol = reference.tolerance
    assert (tol("bfloat16", "o"), tol("bfloat16", "ht"), tol("bfloat16", "dq"),
            tol("bfloat16", "dh0"), tol("bfloat16", "dg")) == (5e-3, 5e-3, 1e-2, 1e-2, 2e-2)
    assert tol("float16", "dg") == 2e-2 and tol("float32", "dv") == 1e-4
    assert tol("float64", "dg") <= 1e-12
    with pytest.raises(ValueError, match="int8"):
        tol("int8", "o")
    with pytest.raises(ValueError, match="dz"):
        tol("float32", "dz")


def test_rel_error_and_the_c_header_of_the_table():
    assert reference.rel_error([1.0, 2.0], [1.0, 2.0]) == 0.0
    assert reference.rel_error([np.nan, 2.0], [1.0, 2.0]) == float("inf")
    assert reference.rel_error([3.0, 4.0], [0.0, 0.0]) == 5.0
    header = reference.c_header()
    assert "fq_tolerance(fq_dtype dt, fq_tol_what what)" in header
    assert "case FQ_BF16: return what == FQ_TOL_OUT ? 0.005 : what == FQ_TOL_GRAD ? 0.01 : 0.02;" in header
