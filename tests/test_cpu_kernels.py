"""Shapes that reach every part of the CPU kernel sets (gdn_cpu_kernels.h) on
any of them: full and edge GEMM tiles (K, V not multiples of 32 or of the
register tile), the recurrent step's wide / middle / one-vector / portable
column blocks (V = 128, 80, 50), token groups longer than one pass (T = 70),
and the half-precision tile loads and stores (bf16, fp16) in the forward and
the recurrent step, against the float64 reference on NaN-poisoned outputs.
Runs under the default kernel set here and under each forced set from
test_cpu_isa.py."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashqla  # noqa: E402
from flashqla import reference  # noqa: E402
from gdn_testing import (assert_close, c_chunk_fwd, cast_inputs_torch, make_inputs,  # noqa: E402
                         reference_of, to_f64, tolerance)


@pytest.mark.parametrize("K,V", [(128, 128), (48, 80), (64, 50)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_forward_head_dims_and_half_tiles(K, V, dtype):
    l2 = K == 128
    inp = make_inputs(1, 75, 1, 2, K, V, seed=K + V, normalize_qk=not l2)
    t = cast_inputs_torch(inp, dtype)
    ref = reference_of(t, use_qk_l2norm=l2, grads=False)
    o, ht = c_chunk_fwd(t, use_qk_l2norm=l2)
    assert_close("o", o, ref["o"], tolerance(dtype, "o"))
    assert_close("final_state", ht, ref["ht"], tolerance(dtype, "ht"))


# T = 70 (two token groups) in float32; the half-precision tiles at T = 1, 3
REC_CASES = [(K, V, T, dt) for (K, V) in [(128, 128), (48, 80), (32, 50)]
             for T in (1, 3, 70) for dt in ("float32", "bfloat16", "float16")
             if T != 70 or dt == "float32"]


@pytest.mark.parametrize("K,V,T,dtype", REC_CASES)
def test_recurrent_column_blocks_and_half_tiles(K, V, T, dtype):
    N, H, HV = 3, 1, 2
    l2 = K == 128
    inp = make_inputs(N, T, H, HV, K, V, seed=T + K, h0=False, normalize_qk=not l2)
    t = cast_inputs_torch(inp, dtype)
    rng = np.random.default_rng(T)
    pool = torch.tensor(rng.standard_normal((N + 1, HV, K, V)) * 0.5, dtype=torch.float32)
    idx = torch.tensor([3, 0, 1], dtype=torch.int32)
    o_ref, pool_ref = reference.recurrent(*(to_f64(t[n]) for n in ("q", "k", "v", "g", "beta")),
                                          to_f64(pool), state_indices=idx.numpy(), use_qk_l2norm=l2)
    o = flashqla.gdn_recurrent(t["q"], t["k"], t["v"], t["g"], t["beta"], pool,
                               state_indices=idx, use_qk_l2norm=l2)
    assert_close("o", o, o_ref, tolerance(dtype, "o"))
    assert_close("state", pool, pool_ref, tolerance(dtype, "ht"))


def test_recurrent_thread_counts_agree():
    """The decode step splits (sequence, head) items over threads: the result
    is the same bits at every thread count."""
    from flashqla import _C
    N, H, HV, K, V = 8, 2, 8, 64, 64
    inp = make_inputs(N, 1, H, HV, K, V, seed=11, h0=False)
    t = cast_inputs_torch(inp, "float32")
    pool0 = torch.tensor(np.random.default_rng(2).standard_normal((N, HV, K, V)) * 0.5,
                         dtype=torch.float32)
    outs = []
    for threads in (1, 2, 3, 1):
        pool = pool0.clone()
        o = torch.full_like(t["v"], float("nan"))
        _C.recurrent(t["q"], t["k"], t["v"], t["g"], t["beta"], pool, o, scale=K ** -0.5,
                     num_threads=threads)
        outs.append((o, pool))
    for o, pool in outs[1:]:
        assert torch.equal(o, outs[0][0]) and torch.equal(pool, outs[0][1])
