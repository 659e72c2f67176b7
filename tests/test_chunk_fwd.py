"""Chunked forward on the CPU backend against the float64 reference.

Each case calls flashqla._C.chunk_fwd directly on NaN-poisoned o and
final_state buffers (an unwritten element fails), with torch CPU tensors as
inputs (bf16 needs them), and compares with DESIGN §3's tolerances."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashqla  # noqa: E402
from gdn_testing import (CPU_CASE_IDS, CPU_CASES, assert_close, c_chunk_fwd,  # noqa: E402
                         case_inputs, make_inputs, reference_of, tolerance)


@pytest.mark.parametrize("case", CPU_CASES, ids=CPU_CASE_IDS)
def test_forward_matches_reference(case):
    name, sizes, opt = case
    inp, t = case_inputs(case)
    ref = reference_of(t, use_qk_l2norm=opt["l2norm"], scale=opt["scale"], grads=False)
    o, ht = c_chunk_fwd(t, scale=opt["scale"], use_qk_l2norm=opt["l2norm"])
    assert o.dtype == t["q"].dtype
    assert ht.dtype == (torch.float64 if opt["dtype"] == "float64" else torch.float32)
    assert_close("o", o, ref["o"], tolerance(opt["dtype"], "o"))
    assert_close("final_state", ht, ref["ht"], tolerance(opt["dtype"], "ht"))


def test_forward_without_final_state_and_empty_sequences():
    inp = make_inputs(1, 10, 1, 2, 16, 16, seqlens=[0, 10, 0], seed=5)
    from gdn_testing import cast_inputs_torch
    t = cast_inputs_torch(inp, "float32")
    o, none = c_chunk_fwd(t, final_state=False)
    assert none is None
    ref = reference_of(t, grads=False)
    assert_close("o", o, ref["o"], tolerance("float32", "o"))
    _, ht = c_chunk_fwd(t)
    # an empty sequence's final state is its initial state
    np.testing.assert_array_equal(ht[0].numpy(), t["h0"][0].numpy())
    np.testing.assert_array_equal(ht[2].numpy(), t["h0"][2].numpy())


def test_forward_public_api_numpy_fp64_matches_reference():
    inp = make_inputs(2, 70, 2, 4, 16, 16, seed=6)
    ref = reference_of(inp, grads=False)
    o, ht = flashqla.gdn_chunk(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                               initial_state=inp["h0"], output_final_state=True)
    assert isinstance(o, np.ndarray) and o.dtype == np.float64
    assert_close("o", o, ref["o"], tolerance("float64", "o"))
    assert_close("final_state", ht, ref["ht"], tolerance("float64", "ht"))


def test_forward_is_deterministic_and_thread_count_independent():
    from flashqla import _C
    inp = make_inputs(2, 130, 2, 4, 32, 32, seed=7)
    from gdn_testing import cast_inputs_torch
    t = cast_inputs_torch(inp, "float32")
    outs = []
    for threads in (1, 2, 1):
        o = torch.full_like(t["v"], float("nan"))
        ht = torch.full_like(t["h0"], float("nan"))
        _C.chunk_fwd(t["q"], t["k"], t["v"], t["g"], t["beta"], o, scale=32 ** -0.5,
                     initial_state=t["h0"], final_state=ht, num_threads=threads)
        outs.append((o, ht))
    for o, ht in outs[1:]:
        assert torch.equal(o, outs[0][0]) and torch.equal(ht, outs[0][1])
