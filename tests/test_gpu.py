"""The CUDA backend against the float64 reference, through _C (NaN-poisoned
outputs) and through the public API (PyTorch CUDA tensors, CuPy, JAX GPU
arrays): forward, backward, autograd, T = 32768 with strong decay, padded
varlen batches, K = V = 64 and 128, bf16 / fp16 / fp32 inputs, bad inputs,
K = V = 256 (forward, backward, recurrent step),
a CUDA-graph capture and replay of forward + backward, and the recurrent
step against the CPU backend.

Every test here is marked `gpu` (skipped without a CUDA device or without
the CUDA build, see conftest.py).

Tolerances: DESIGN §3's bf16 budget for every input dtype on the GPU (the
CUDA backend may run float32 inputs through bf16 tensor-core stages, which
issue 3 allows); float32 agreement of the recurrent step with the CPU backend
at TOL_FP32_CPU-scaled bounds.
"""

import numpy as np
import pytest

import flashqla
from flashqla import reference
from gdn_testing import (GRAD_NAMES, assert_close, c_chunk_bwd, c_chunk_fwd, cast_inputs_torch, gpu_tol,
                         make_inputs, pool_prefill_matches_gather, reference_of, to_f64)

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")


def _case(B, T, H, HV, K, V, **opts):
    opts.setdefault("dtype", "bfloat16")
    opts.setdefault("gate", "float32")
    opts.setdefault("h0", True)
    opts.setdefault("l2norm", False)
    opts.setdefault("seqlens", None)
    opts.setdefault("a_max", 16.0)
    if opts["seqlens"] is not None:
        T = sum(opts["seqlens"])
    return (B, T, H, HV, K, V), opts


GPU_CASES = {
    "bf16-K128": _case(2, 300, 2, 4, 128, 128),
    "fp16-K128": _case(2, 300, 2, 4, 128, 128, dtype="float16"),
    "fp32-K128": _case(2, 300, 2, 4, 128, 128, dtype="float32"),
    "bf16-gates-bf16": _case(1, 200, 2, 4, 128, 128, gate="bfloat16"),
    "bf16-K64": _case(2, 300, 2, 4, 64, 64),
    "fp32-K64": _case(1, 200, 1, 2, 64, 64, dtype="float32"),
    "K64-V128": _case(1, 200, 1, 2, 64, 128),
    "gva1": _case(1, 200, 2, 2, 128, 128),
    "gva4": _case(1, 200, 1, 4, 128, 128),
    "no-h0": _case(2, 130, 1, 2, 128, 128, h0=False),
    "l2norm": _case(2, 130, 1, 2, 128, 128, l2norm=True),
    "T1": _case(3, 1, 1, 2, 128, 128),
    "T64": _case(1, 64, 1, 2, 128, 128),
    "zero-decay": _case(1, 2000, 1, 2, 128, 128, a_max=0.0),
    "varlen-padded": _case(1, 0, 2, 4, 128, 128, seqlens=[1, 63, 0, 64, 65, 1000, 7]),
    "T32768-strong-decay": _case(1, 32768, 1, 2, 128, 128, a_max=16.0),
    # K = V = 256 (issue 7 item 4): the three-stage forward, the backward's
    # 64-row h slices in bwd_local and its K-split bwd_state
    "bf16-K256-varlen-gva": _case(1, 0, 2, 4, 256, 256, seqlens=[1, 63, 64, 65, 0, 100]),
    "fp32-K256-l2norm": _case(1, 130, 1, 2, 256, 256, dtype="float32", l2norm=True),
    # sequences x value heads filling enough of a wave of 132 SMs (>= 0.83 at HV >= 32, 0.6 at
    # HV = 16, 0.45 below): on sm_90a the backward's reverse pass is the fused kernel bwd_rev90
    # there (fq_bwd_rev_path), the cases above take bwd_state90 + bwd_wy90; its dv stores have a
    # bf16 path and a generic one (fp16, fp32 outputs)
    "rev90-bf16-batch": _case(4, 200, 8, 32, 128, 128),
    "rev90-fp16-varlen-l2norm": _case(1, 0, 4, 16, 128, 128, dtype="float16", l2norm=True,
                                      seqlens=[1, 63, 0, 64, 65, 300, 7, 130]),
    "rev90-fp32-no-h0": _case(2, 130, 16, 64, 128, 128, dtype="float32", h0=False),
    "rev90-hv8-partial-wave": _case(9, 150, 4, 8, 128, 128),
}


def _inputs(case, seed=0):
    (B, T, H, HV, K, V), o = case
    inp = make_inputs(B, T, H, HV, K, V, seed=seed, h0=o["h0"], seqlens=o["seqlens"],
                      a_max=o["a_max"], normalize_qk=not o["l2norm"], dht=True)
    return inp, cast_inputs_torch(inp, o["dtype"], o["gate"], device="cuda")


@pytest.mark.parametrize("name", list(GPU_CASES))
def test_cuda_forward_backward_match_reference(name):
    case = GPU_CASES[name]
    opt = case[1]
    _, t = _inputs(case)
    o, ht = c_chunk_fwd(t, use_qk_l2norm=opt["l2norm"])
    d = c_chunk_bwd(t, use_qk_l2norm=opt["l2norm"])
    torch.cuda.synchronize()
    ref = reference_of(t, use_qk_l2norm=opt["l2norm"])
    assert o.dtype == t["q"].dtype and o.device.type == "cuda"
    assert_close("o", o, ref["o"], gpu_tol("o"))
    assert_close("final_state", ht, ref["ht"], gpu_tol("ht"))
    for g in GRAD_NAMES:
        if g == "dh0" and t["h0"] is None:
            continue
        assert_close(g, d[g], ref[g], gpu_tol(g))


@pytest.mark.parametrize("H, HV, seqlens", [(2, 4, [3000, 1, 700]), (11, 44, [700, 1, 300])],
                         ids=["context-parallel", "rev90"])
def test_cuda_forward_and_backward_are_bitwise_deterministic_over_100_runs(H, HV, seqlens):
    # issue 8 item 3: no float atomics whose order varies. 100 runs of the same forward
    # and backward (GVA, varlen with a sequence long enough for context parallelism's
    # segments, the L2 norm in the kernels) give the same bits, -0.0 / +0.0 included;
    # the second shape (sequences x value heads = 132) takes the fused reverse pass bwd_rev90.
    inp, t = _inputs(_case(1, 0, H, HV, 128, 128, seqlens=seqlens, l2norm=True))

    def bits(x):
        return x.contiguous().view(torch.uint8)

    o0, ht0 = c_chunk_fwd(t, use_qk_l2norm=True)
    d0 = c_chunk_bwd(t, use_qk_l2norm=True)
    ref = reference_of(t, use_qk_l2norm=True)
    assert_close("o", o0, ref["o"], gpu_tol("o"))
    for g in GRAD_NAMES:
        assert_close(g, d0[g], ref[g], gpu_tol(g))
    first = [bits(x) for x in (o0, ht0, *(d0[g] for g in GRAD_NAMES))]
    for run in range(99):
        o, ht = c_chunk_fwd(t, use_qk_l2norm=True)
        d = c_chunk_bwd(t, use_qk_l2norm=True)
        again = [bits(x) for x in (o, ht, *(d[g] for g in GRAD_NAMES))]
        for name, a, b in zip(("o", "final_state") + tuple(GRAD_NAMES), first, again):
            assert torch.equal(a, b), f"run {run + 2}: {name} differs from run 1"


@pytest.mark.parametrize("K, H, HV, T, l2norm", [(128, 16, 32, 1000, False), (64, 24, 48, 333, True)])
def test_cuda_stage_a_beside_the_state_pass_matches_reference_and_the_batched_bits(K, H, HV, T, l2norm):
    # issue 7: one sequence with enough value heads for no context parallelism
    # (HV (K + V) / 64 > 80) and at most half the SMs of state-pass CTAs runs
    # stage A beside the state pass (fq_cuda_fwd_beside: per-chunk ready flags);
    # the same sequence packed after another one (twice the CTAs) runs the two one
    # after the other. Both against the float64 reference, and the sequence's bits
    # the same both ways.
    if torch.cuda.get_device_properties(0).multi_processor_count < 2 * HV * (K // 64):
        pytest.skip("too few SMs for stage A beside the state pass")
    inp, t = _inputs(_case(1, T, H, HV, K, K, l2norm=l2norm))
    o1, ht1 = c_chunk_fwd(t, use_qk_l2norm=l2norm)
    torch.cuda.synchronize()
    ref = reference_of(t, use_qk_l2norm=l2norm, grads=False)
    assert_close("o", o1, ref["o"], gpu_tol("o"))
    assert_close("final_state", ht1, ref["ht"], gpu_tol("ht"))
    lead = 200  # another sequence before it
    _, tb = _inputs(_case(1, 0, H, HV, K, K, l2norm=l2norm, seqlens=[lead, T]), seed=5)
    for n in ("q", "k", "v", "g", "beta"):
        tb[n][:, lead:] = t[n]
    tb["h0"][1] = t["h0"][0]
    o2, ht2 = c_chunk_fwd(tb, use_qk_l2norm=l2norm)
    torch.cuda.synchronize()

    def bits(x):
        return x.contiguous().view(torch.uint8)

    assert torch.equal(bits(o1[0]), bits(o2[0, lead:]))
    assert torch.equal(bits(ht1[0]), bits(ht2[1]))


@pytest.mark.parametrize("H, HV, T, l2norm", [(16, 32, 1000, False), (4, 8, 2048, True)],
                         ids=["one-chain-per-head", "context-parallel"])
def test_cuda_bwd_wy_beside_the_reverse_chains_matches_reference_and_the_batched_bits(H, HV, T, l2norm):
    # issue 8: where bwd_state90's chains leave at least 16 SMs free, bwd_wy90 runs beside
    # them, each block waiting for the flags of its chunk that the chains set as they store
    # dS_next and dVn (fq_bwd_wy_beside): on 132 SMs one sequence alone, 64 CTAs at 16/32,
    # 80 at 4/8 (context parallelism: 2048 tokens in four segments, five slots), in the
    # order of the chains (the segments' ends first). Packed before a sequence of 1100
    # tokens the chains need more than that allows (128 CTAs at 16/32; 8 segment slots x 16
    # at 4/8) and bwd_wy90 runs after them. Against the float64 reference, and the sequence's
    # gradient bits the same both ways (on any GPU: only the scheduling differs).
    _, t = _inputs(_case(1, T, H, HV, 128, 128, l2norm=l2norm))
    d1 = c_chunk_bwd(t, use_qk_l2norm=l2norm)
    torch.cuda.synchronize()
    ref = reference_of(t, use_qk_l2norm=l2norm)
    for g in GRAD_NAMES:
        assert_close(g, d1[g], ref[g], gpu_tol(g))
    _, tb = _inputs(_case(1, 0, H, HV, 128, 128, l2norm=l2norm, seqlens=[T, 1100]), seed=5)
    for n in ("q", "k", "v", "g", "beta", "do"):
        tb[n][:, :T] = t[n]
    tb["h0"][0] = t["h0"][0]
    tb["dht"][0] = t["dht"][0]
    d2 = c_chunk_bwd(tb, use_qk_l2norm=l2norm)
    torch.cuda.synchronize()

    def bits(x):
        return x.contiguous().view(torch.uint8)

    for g in ("dq", "dk", "dv", "dg", "dbeta"):
        assert torch.equal(bits(d1[g][0]), bits(d2[g][0, :T])), f"{g}: the packed sequence's bits differ"
    assert torch.equal(bits(d1["dh0"][0]), bits(d2["dh0"][0])), "dh0: the packed sequence's bits differ"


def test_cuda_paired_ctas_match_reference_and_the_bits_of_a_sequence_alone():
    # issue 7: where the fused forward's CTAs (one per value head and 64 state
    # columns) would need more than one wave, one CTA takes both column blocks of
    # its value head (two chains sharing Q, K, A'' and P: fq_fwd_pair). A sequence
    # alone (64 CTAs at HV = 32) and packed between two others (192: paired) give
    # the same bits, both against the float64 reference; a NaN in one v column of
    # the batch changes only its value head's block of 64 columns, from its token on.
    H, HV, K, T = 16, 32, 128, 300
    if torch.cuda.get_device_properties(0).multi_processor_count >= 3 * HV * (K // 64):
        pytest.skip("one wave holds the unpaired CTAs on this GPU")
    _, t = _inputs(_case(1, T, H, HV, K, K))
    o1, ht1 = c_chunk_fwd(t)
    torch.cuda.synchronize()
    ref = reference_of(t, grads=False)
    assert_close("o", o1, ref["o"], gpu_tol("o"))
    assert_close("final_state", ht1, ref["ht"], gpu_tol("ht"))
    lead = 200
    _, tb = _inputs(_case(1, 0, H, HV, K, K, seqlens=[lead, T, 250]), seed=5)
    for n in ("q", "k", "v", "g", "beta"):
        tb[n][:, lead:lead + T] = t[n]
    tb["h0"][1] = t["h0"][0]
    o2, ht2 = c_chunk_fwd(tb)
    torch.cuda.synchronize()
    refb = reference_of(tb, grads=False)
    assert_close("o (batch)", o2, refb["o"], gpu_tol("o"))
    assert_close("final_state (batch)", ht2, refb["ht"], gpu_tol("ht"))

    def bits(x):
        return x.contiguous().view(torch.int16 if x.element_size() == 2 else torch.int32)

    assert torch.equal(bits(o1[0]), bits(o2[0, lead:lead + T]))
    assert torch.equal(bits(ht1[0]), bits(ht2[1]))
    tok, col = 150, 70  # value head 0, column block 1
    tn = {n: (x.clone() if isinstance(x, torch.Tensor) else x) for n, x in tb.items()}
    tn["v"][0, lead + tok, 0, col] = float("nan")
    o3, ht3 = c_chunk_fwd(tn)
    torch.cuda.synchronize()
    hit = torch.zeros(o3.shape, dtype=torch.bool, device=o3.device)
    hit[0, lead + tok:lead + T, 0, 64:] = True
    assert torch.equal(bits(o3)[~hit], bits(o2)[~hit]), "a bit outside the NaN's block and tokens changed"
    assert torch.isnan(o3[0, lead + tok:lead + T, 0, 64:]).any(dim=-1).all(), "a finite row of the NaN's block after it"
    hs = torch.zeros(ht3.shape, dtype=torch.bool, device=ht3.device)
    hs[1, 0, :, 64:] = True
    assert torch.equal(bits(ht3)[~hs], bits(ht2)[~hs])
    assert torch.isnan(ht3[1, 0, :, 64:]).any()


def test_cuda_matches_cpu_backend_fp32():
    """The same float32 inputs on both backends agree to the GPU budget."""
    inp, t = _inputs(_case(1, 500, 2, 4, 128, 128, dtype="float32", seqlens=[100, 400]))
    tc = cast_inputs_torch(inp, "float32")
    o_gpu, ht_gpu = flashqla.gdn_chunk(t["q"], t["k"], t["v"], t["g"], t["beta"],
                                       initial_state=t["h0"], output_final_state=True,
                                       cu_seqlens=t["cu_seqlens"])
    o_cpu, ht_cpu = flashqla.gdn_chunk(tc["q"], tc["k"], tc["v"], tc["g"], tc["beta"],
                                       initial_state=tc["h0"], output_final_state=True,
                                       cu_seqlens=tc["cu_seqlens"])
    assert_close("o (cuda vs cpu)", o_gpu, to_f64(o_cpu), gpu_tol("o"))
    assert_close("final_state (cuda vs cpu)", ht_gpu, to_f64(ht_cpu), gpu_tol("ht"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_cuda_autograd_matches_reference(dtype):
    inp, t = _inputs(_case(1, 300, 2, 4, 128, 128, dtype=dtype, seqlens=[100, 1, 199],
                           l2norm=True))
    leaves = {n: t[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "h0")}
    o, ht = flashqla.gdn_chunk(leaves["q"], leaves["k"], leaves["v"], leaves["g"],
                               leaves["beta"], initial_state=leaves["h0"],
                               output_final_state=True, cu_seqlens=t["cu_seqlens"],
                               use_qk_l2norm=True)
    assert o.is_cuda and o.dtype == t["q"].dtype and ht.dtype == torch.float32
    ((o.float() * t["do"].float()).sum() + (ht * t["dht"]).sum()).backward()
    ref = reference_of(t, use_qk_l2norm=True)
    assert_close("o", o, ref["o"], gpu_tol("o"))
    for name, leaf in zip(GRAD_NAMES, leaves.values()):
        assert leaf.grad.dtype == leaf.dtype and leaf.grad.is_cuda
        assert_close(name, leaf.grad, ref[name], gpu_tol(name))


def test_cuda_fla_signature():
    inp, t = _inputs(_case(1, 256, 2, 4, 128, 128, seqlens=[128, 128]))
    o, ht = flashqla.chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"],
                                            initial_state=t["h0"], output_final_state=True,
                                            cu_seqlens=t["cu_seqlens"])
    ref = reference_of(t, grads=False)
    assert_close("o", o, ref["o"], gpu_tol("o"))
    assert_close("final_state", ht, ref["ht"], gpu_tol("ht"))


def test_cuda_graph_capture_replays_forward_and_backward():
    inp, t = _inputs(_case(1, 1000, 2, 4, 128, 128))
    static = {n: t[n].clone() for n in ("q", "k", "v", "g", "beta", "h0", "do", "dht")}

    def step():
        o, ht, ctx = flashqla.gdn_chunk_fwd(static["q"], static["k"], static["v"], static["g"],
                                            static["beta"], initial_state=static["h0"],
                                            output_final_state=True)
        grads = flashqla.gdn_chunk_bwd(ctx, static["do"], static["dht"])
        return (o, ht) + tuple(grads)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch asks
        eager = [x.clone() for x in step()]
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for x in outs:
        x.fill_(float("nan"))  # the replay has to write every element again
    graph.replay()
    torch.cuda.synchronize()
    names = ("o", "final_state") + GRAD_NAMES
    for name, got, want in zip(names, outs, eager):
        assert_close(f"{name} (graph replay vs eager)", got, to_f64(want), 1e-6)
    # new values in the static inputs: the replay computes with them
    inp2, t2 = _inputs(_case(1, 1000, 2, 4, 128, 128), seed=1)
    for n in static:
        static[n].copy_(t2[n])
    graph.replay()
    torch.cuda.synchronize()
    ref = reference_of(t2)
    assert_close("o (replay, new inputs)", outs[0], ref["o"], gpu_tol("o"))
    for name, got in zip(GRAD_NAMES, outs[2:]):
        assert_close(f"{name} (replay, new inputs)", got, ref[name], gpu_tol(name))


@pytest.mark.parametrize("T", [1, 4, 100])  # 100: 25 groups of 4 tokens through one stage
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_recurrent_matches_cpu_and_reference(T, index_dtype, dtype):
    N, H, HV, K, V, P = 6, 2, 4, 128, 128, 9
    inp = make_inputs(N, T, H, HV, K, V, seed=T, h0=False)
    t = cast_inputs_torch(inp, dtype, "float32", device="cuda")
    tc = cast_inputs_torch(inp, dtype, "float32")
    rng = np.random.default_rng(0)
    pool_cpu = torch.tensor(rng.standard_normal((P, HV, K, V)) * 0.5, dtype=torch.float32)
    before = pool_cpu.clone()
    pool_gpu = pool_cpu.cuda()
    idx = torch.tensor([8, -1, 0, 3, -1, 5], dtype=index_dtype)
    o_gpu = flashqla.gdn_recurrent(t["q"], t["k"], t["v"], t["g"], t["beta"], pool_gpu,
                                   state_indices=idx.cuda())
    o_cpu = flashqla.gdn_recurrent(tc["q"], tc["k"], tc["v"], tc["g"], tc["beta"], pool_cpu,
                                   state_indices=idx)
    torch.cuda.synchronize()
    o_ref, pool_ref = reference.recurrent(*(to_f64(tc[n]) for n in ("q", "k", "v", "g", "beta")),
                                          to_f64(before), state_indices=idx.numpy())
    live, pad = [0, 2, 3, 5], [1, 4]
    assert o_gpu.is_cuda and o_gpu.dtype == t["q"].dtype
    assert torch.count_nonzero(o_gpu[pad]) == 0, "padded sequences must get o = 0"
    assert_close("o (cuda)", o_gpu[live], o_ref[live], gpu_tol("o"))
    assert_close("o (cuda vs cpu)", o_gpu[live], to_f64(o_cpu[live]), gpu_tol("o"))
    assert_close("state (cuda)", pool_gpu, pool_ref, gpu_tol("ht"))
    assert_close("state (cuda vs cpu)", pool_gpu, to_f64(pool_cpu), gpu_tol("ht"))
    for s in (1, 2, 4, 6, 7):
        assert torch.equal(pool_gpu[s].cpu(), before[s]), f"slot {s} must not change"


def test_cuda_recurrent_equals_chunked_forward():
    inp, t = _inputs(_case(2, 40, 2, 4, 128, 128, dtype="float32"))
    o_chunk, ht_chunk = flashqla.gdn_chunk(t["q"], t["k"], t["v"], t["g"], t["beta"],
                                           initial_state=t["h0"], output_final_state=True)
    pool = t["h0"].clone()
    outs = [flashqla.gdn_recurrent(t["q"][:, s:s + 4], t["k"][:, s:s + 4], t["v"][:, s:s + 4],
                                   t["g"][:, s:s + 4], t["beta"][:, s:s + 4], pool)
            for s in range(0, 40, 4)]
    o_rec = torch.cat(outs, dim=1)
    assert_close("o (recurrent vs chunked)", o_rec, to_f64(o_chunk), gpu_tol("o"))
    assert_close("state (recurrent vs chunked)", pool, to_f64(ht_chunk), gpu_tol("ht"))


# ----------------------------------------------------------- K = V = 256 ----
# issue 7 item 4: the CUDA chunked forward (the three-stage forward; the fused
# sm_90a one takes 64 and 128 only), its backward and the recurrent step take
# K = V = 256 (forward and backward against the reference: GPU_CASES above).

K256_CASES = {
    "bf16-varlen-gva": _case(1, 0, 2, 4, 256, 256, seqlens=[1, 63, 64, 65, 0, 300]),
    "fp16-no-h0": _case(2, 130, 1, 2, 256, 256, dtype="float16", h0=False),
    "T2048-strong-decay": _case(1, 2048, 1, 2, 256, 256, a_max=16.0),
}


@pytest.mark.parametrize("name", list(K256_CASES))
def test_cuda_forward_k256_matches_reference(name):
    case = K256_CASES[name]
    opt = case[1]
    _, t = _inputs(case)
    o, ht = c_chunk_fwd(t, use_qk_l2norm=opt["l2norm"])  # on NaN-filled outputs
    torch.cuda.synchronize()
    ref = reference_of(t, use_qk_l2norm=opt["l2norm"], grads=False)
    assert o.dtype == t["q"].dtype and o.device.type == "cuda"
    assert_close("o", o, ref["o"], gpu_tol("o"))
    assert_close("final_state", ht, ref["ht"], gpu_tol("ht"))


def test_cuda_k256_autograd_matches_reference():
    """gdn_chunk at K = V = 256 on CUDA through autograd (forward and
    backward) against the reference; 256 with another head dim is refused."""
    _, t = _inputs(_case(1, 0, 1, 2, 256, 256, seqlens=[70, 58], l2norm=True))
    leaves = {n: t[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "h0")}
    o, ht = flashqla.gdn_chunk(leaves["q"], leaves["k"], leaves["v"], leaves["g"],
                               leaves["beta"], initial_state=leaves["h0"],
                               output_final_state=True, cu_seqlens=t["cu_seqlens"],
                               use_qk_l2norm=True)
    ((o.float() * t["do"].float()).sum() + (ht * t["dht"]).sum()).backward()
    ref = reference_of(t, use_qk_l2norm=True)
    assert_close("o", o, ref["o"], gpu_tol("o"))
    assert_close("final_state", ht, ref["ht"], gpu_tol("ht"))
    for name, leaf in zip(GRAD_NAMES, leaves.values()):
        assert leaf.grad.dtype == leaf.dtype and leaf.grad.is_cuda
        assert_close(name, leaf.grad, ref[name], gpu_tol(name))
    with pytest.raises(ValueError, match="^v:.*K = V = 256"):   # 256 only as K = V = 256
        flashqla.gdn_chunk(t["q"], t["k"], t["v"][..., :128].contiguous(), t["g"], t["beta"])


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("T", [1, 6])  # 1: one token per stage; 6: two groups of 4
def test_cuda_recurrent_k256_matches_reference(T, layout):
    N, H, HV, K, V, P = 4, 1, 2, 256, 256, 6
    inp = make_inputs(N, T, H, HV, K, V, seed=10 + T, h0=False)
    t = cast_inputs_torch(inp, "bfloat16", "float32", device="cuda")
    rng = np.random.default_rng(1)
    pool = torch.tensor(rng.standard_normal((P, HV, K, V)) * 0.5, dtype=torch.float32)
    idx = torch.tensor([5, -1, 0, 3], dtype=torch.int32)
    o_ref, pool_ref = reference.recurrent(*(to_f64(t[n]) for n in ("q", "k", "v", "g", "beta")),
                                          pool.double().numpy(), state_indices=idx.numpy())
    pool_gpu = pool.cuda() if layout == "kv" else pool.transpose(2, 3).contiguous().cuda()
    o = flashqla.gdn_recurrent(t["q"], t["k"], t["v"], t["g"], t["beta"], pool_gpu,
                               state_indices=idx.cuda(), state_layout=layout)
    torch.cuda.synchronize()
    if layout == "vk":
        pool_gpu = pool_gpu.transpose(2, 3)
    live = [0, 2, 3]
    assert torch.count_nonzero(o[1]) == 0, "a padded sequence gets o = 0"
    assert_close("o", o[live], o_ref[live], gpu_tol("o"))
    assert_close("state", pool_gpu, pool_ref, gpu_tol("ht"))
    for s in (1, 2, 4):
        assert torch.equal(pool_gpu[s].cpu(), pool[s]), f"slot {s} must not change"


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_cuda_k256_pool_prefill_and_checkpoints(layout):
    """The serving forms of the K = V = 256 forward (stage B's pool, layout
    and checkpoint code at K = 256): prefill through a pool equals gather ->
    gdn_chunk -> scatter bit for bit and the reference; checkpoints every 64
    tokens match the reference's states, the last one of a sequence whose
    length is a multiple of 64 is its final state bit for bit."""
    seqlens = [70, 0, 1, 300, 64]
    inp, t = _inputs(_case(1, 0, 2, 4, 256, 256, seqlens=seqlens, h0=False))
    args = [t[n] for n in ("q", "k", "v", "g", "beta")]
    cu = t["cu_seqlens"]
    tr = (lambda x: x) if layout == "kv" else (lambda x: x.transpose(-1, -2).contiguous())
    pool = tr(torch.randn(7, 4, 256, 256, device="cuda") * 0.5)
    idx = torch.tensor([5, -1, 2, 6, 0], dtype=torch.int32, device="cuda")
    o, got, h0, o_ref, ht = pool_prefill_matches_gather(args, pool, idx, cu, layout)
    f = [to_f64(x) for x in args]
    h0kv = to_f64(tr(h0))
    ro, rht = reference.forward(*f, initial_state=h0kv, cu_seqlens=inp["cu_seqlens"])
    assert_close("o", o, ro, gpu_tol("o"))
    assert_close("slot 6", tr(got[6]), rht[3], gpu_tol("ht"))
    # checkpoints (from the same h0)
    o2, ht2, (ck, cuck) = flashqla.gdn_chunk(*args, initial_state=h0, output_final_state=True,
                                             cu_seqlens=cu, checkpoint_every=64, state_layout=layout)
    torch.cuda.synchronize()
    assert torch.equal(o2, o_ref) and torch.equal(ht2, ht)
    counts = [L // 64 for L in seqlens]
    assert cuck.cpu().tolist() == list(np.concatenate([[0], np.cumsum(counts)]))
    traj = reference.states(*f, initial_state=h0kv, cu_seqlens=inp["cu_seqlens"])
    c0 = cuck.cpu().tolist()
    for n, L in enumerate(seqlens):
        for c in range(L // 64):
            assert_close(f"seq {n} ckpt {c}", tr(ck[c0[n] + c]), traj[n][64 * (c + 1) - 1], gpu_tol("ht"))
        if L and L % 64 == 0:
            assert torch.equal(ck[c0[n + 1] - 1], ht[n])
    assert torch.all(ck[c0[-1]:] == 0)


# ------------------------------------------------------------ bad inputs ----

def _base_cuda():
    inp = make_inputs(1, 64, 1, 2, 128, 128, seed=3)
    return cast_inputs_torch(inp, "bfloat16", device="cuda")


def test_cuda_bad_inputs_raise():
    t = _base_cuda()
    args = [t[n] for n in ("q", "k", "v", "g", "beta")]
    with pytest.raises(ValueError, match="k"):       # a CPU k with a CUDA q
        flashqla.gdn_chunk(args[0], args[1].cpu(), *args[2:])
    with pytest.raises(ValueError, match="q"):       # a CPU q with CUDA k
        flashqla.gdn_chunk(args[0].cpu(), *args[1:])
    with pytest.raises(ValueError, match="initial_state"):
        flashqla.gdn_chunk(*args, initial_state=t["h0"].cpu())
    with pytest.raises(TypeError, match="k"):
        flashqla.gdn_chunk(args[0], args[1].half(), *args[2:])
    with pytest.raises(ValueError, match="K"):       # head dim the CUDA backend does not take
        q = torch.nn.functional.normalize(torch.randn(1, 64, 1, 96, device="cuda"), dim=-1)
        flashqla.gdn_chunk(q.bfloat16(), q.bfloat16(), *args[2:])
    with pytest.raises(ValueError, match="cu_seqlens"):
        flashqla.gdn_chunk(*[a.expand(2, *a.shape[1:]).contiguous() for a in args],
                           cu_seqlens=torch.tensor([0, 64], device="cuda"))
    with pytest.raises(TypeError, match="q"):        # float64 is CPU-only
        flashqla.gdn_chunk(*[a.double() for a in args[:3]], *args[3:])


def test_cuda_recurrent_bad_inputs_leave_state_untouched():
    t = cast_inputs_torch(make_inputs(2, 1, 1, 2, 128, 128, seed=4, h0=False), "bfloat16",
                          device="cuda")
    args = [t[n] for n in ("q", "k", "v", "g", "beta")]
    pool = torch.randn(3, 2, 128, 128, device="cuda")
    before = pool.clone()
    with pytest.raises(ValueError, match="state"):
        flashqla.gdn_recurrent(*args, pool.cpu(), state_indices=torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="state"):
        flashqla.gdn_recurrent(*args, pool.half(), state_indices=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="state"):
        flashqla.gdn_recurrent(*args, pool.transpose(2, 3), state_indices=torch.tensor([0, 1]))
    torch.cuda.synchronize()
    assert torch.equal(pool, before)


# ---------------------------------------------------------- other frameworks ----

def test_cupy_arrays():
    cupy = pytest.importorskip("cupy")
    inp = make_inputs(1, 200, 1, 2, 128, 128, seed=5, seqlens=[50, 150], dht=True)
    c = {n: None if x is None else cupy.asarray(x.astype(np.int64 if n == "cu_seqlens"
                                                         else np.float32))
         for n, x in inp.items()}
    o, ht, ctx = flashqla.gdn_chunk_fwd(c["q"], c["k"], c["v"], c["g"], c["beta"],
                                        initial_state=c["h0"], output_final_state=True,
                                        cu_seqlens=c["cu_seqlens"])
    assert isinstance(o, cupy.ndarray) and isinstance(ht, cupy.ndarray)
    grads = flashqla.gdn_chunk_bwd(ctx, c["do"], c["dht"])
    ref = reference_of(c)
    assert_close("o", o, ref["o"], gpu_tol("o"))
    assert_close("final_state", ht, ref["ht"], gpu_tol("ht"))
    for name, g in zip(GRAD_NAMES, grads):
        assert isinstance(g, cupy.ndarray)
        assert_close(name, g, ref[name], gpu_tol(name))
    pool = cupy.asarray(np.random.default_rng(1).standard_normal((2, 2, 128, 128)), cupy.float32)
    before = pool.get()
    q1 = {n: c[n][:, :2] for n in ("q", "k", "v", "g", "beta")}
    o1 = flashqla.gdn_recurrent(q1["q"], q1["k"], q1["v"], q1["g"], q1["beta"], pool,
                                cu_seqlens=cupy.asarray([0, 1, 2], cupy.int32))
    o_ref, pool_ref = reference.recurrent(*(q1[n].get() for n in ("q", "k", "v", "g", "beta")),
                                          before, cu_seqlens=[0, 1, 2])
    assert_close("o (recurrent)", o1, o_ref, gpu_tol("o"))
    assert_close("state (recurrent)", pool, pool_ref, gpu_tol("ht"))


def _jax_gpu():
    jax = pytest.importorskip("jax")
    try:
        devs = jax.devices("gpu")
    except RuntimeError:
        devs = []
    if not devs:
        pytest.skip("JAX has no GPU backend here")
    return jax, devs[0]


def test_jax_gpu_arrays_and_grad():
    jax, dev = _jax_gpu()
    import jax.numpy as jnp
    inp = make_inputs(1, 200, 1, 2, 128, 128, seed=6, dht=True)
    j = {n: None if x is None else jax.device_put(jnp.asarray(
        x, jnp.bfloat16 if n in ("q", "k", "v", "do") else jnp.float32), dev)
        for n, x in inp.items()}

    def loss(q, k, v, g, beta, h0):
        o, ht = flashqla.gdn_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        return jnp.sum(o.astype(jnp.float32) * j["do"].astype(jnp.float32)) + jnp.sum(ht * j["dht"])

    o, ht = flashqla.gdn_chunk(j["q"], j["k"], j["v"], j["g"], j["beta"], initial_state=j["h0"],
                               output_final_state=True)
    assert isinstance(o, jax.Array) and next(iter(o.devices())).platform in ("gpu", "cuda")
    names = ("q", "k", "v", "g", "beta", "h0")
    grads = jax.grad(loss, argnums=tuple(range(6)))(*(j[n] for n in names))
    ref = reference_of(j)
    assert_close("o", o, ref["o"], gpu_tol("o"))
    assert_close("final_state", ht, ref["ht"], gpu_tol("ht"))
    for name, g in zip(GRAD_NAMES, grads):
        assert_close(name, g, ref[name], gpu_tol(name))
    import flashqla.jax as fqj
    pool = jax.device_put(jnp.zeros((1, 2, 128, 128), jnp.float32), dev)
    o1, new = fqj.gdn_recurrent(j["q"][:, :1], j["k"][:, :1], j["v"][:, :1], j["g"][:, :1],
                                j["beta"][:, :1], pool)
    o_ref, pool_ref = reference.recurrent(*(to_f64(j[n][:, :1]) for n in ("q", "k", "v", "g", "beta")),
                                          np.zeros((1, 2, 128, 128)))
    assert float(jnp.abs(pool).max()) == 0.0   # the input pool is not modified
    assert_close("o (recurrent)", o1, o_ref, gpu_tol("o"))
    assert_close("new_state", new, pool_ref, gpu_tol("ht"))
