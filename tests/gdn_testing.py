"""Shared test helpers: model-like inputs (DESIGN §3), the tolerances of
DESIGN §3 as named constants, the relative-error check, and runners that call
flashqla._C directly on NaN-poisoned output buffers (CPU or CUDA tensors)."""

import numpy as np

from flashqla import reference

# ---- tolerances: the project's one table, in flashqla/reference.py (DESIGN §3);
# rel = ||out - ref||_2 / ||ref||_2 against the float64 reference. Named constants
# for the tests that want one number.
TOL_BF16_OUT = reference.tolerance("bfloat16", "o")     # bf16 inputs: o, final_state
TOL_BF16_GRAD = reference.tolerance("bfloat16", "dq")   # bf16 inputs: dq, dk, dv, dbeta, dh0
TOL_BF16_DG = reference.tolerance("bfloat16", "dg")     # bf16 inputs: dg
TOL_FP32_CPU = reference.tolerance("float32", "o")      # fp32 inputs on the CPU backend
TOL_FP64 = reference.tolerance("float64", "o")          # fp64 inputs compute in fp64

GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")

# tolerance(dtype_name, what): what is 'o', 'ht' or one of GRAD_NAMES
tolerance = reference.tolerance


def gpu_tol(what):
    """The bf16 tolerance of an output or gradient name (the CUDA tests' inputs)."""
    if what in ("o", "ht"):
        return TOL_BF16_OUT
    return TOL_BF16_DG if what == "dg" else TOL_BF16_GRAD


def to_f64(x):
    """Any array (NumPy, PyTorch, JAX, CuPy) -> float64 NumPy copy."""
    if x is None:
        return None
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        return x.detach().to("cpu").double().numpy()
    if mod == "cupy":
        return x.get().astype(np.float64)
    return np.array(x, dtype=np.float64)


def rel_error(out, ref):
    """||out - ref|| / ||ref|| of any two arrays (NumPy, PyTorch, JAX, CuPy), in float64."""
    return reference.rel_error(to_f64(out), to_f64(ref))


def assert_finite_where_reference(name, out, ref, tol):
    """NaN isolation and causality (issue 9): out is finite wherever the float64
    reference ref is (its NaN pattern is the allowed one), and within tol of it
    there."""
    out = to_f64(out)
    fin = np.isfinite(ref)
    leak = fin & ~np.isfinite(out)
    assert not leak.any(), (f"{name}: {int(leak.sum())} NaN/Inf where the exact result is finite "
                            f"(first at {np.argwhere(leak)[0].tolist()})")
    if fin.any():
        err = rel_error(np.where(fin, out, 0.0), np.where(fin, ref, 0.0))
        assert err <= tol, f"{name}: rel error {err:.3e} > {tol:.1e} on the finite entries"


def assert_close(name, out, ref, tol):
    out64 = to_f64(out)
    bad = ~np.isfinite(out64)
    assert not bad.any(), f"{name}: {int(bad.sum())} non-finite values (first at {np.argwhere(bad)[0]})"
    err = rel_error(out64, ref)
    assert err <= tol, f"{name}: rel error {err:.3e} > tolerance {tol:.1e}"
    return err


# ---- inputs

def decay_rates(HV, a_max=16.0):
    """Per value head A_h from 0 (no decay) to a_max (very strong decay)."""
    return np.linspace(0.0, a_max, HV)


def raw_gates(B, T, HV, seed=0, dt_bias=True):
    """Raw fused-gate inputs: a, b [B, T, HV] ~ randn, A_log [HV] (decay rates
    0.05 .. 8) and dt_bias [HV] ~ randn (None without dt_bias)."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((B, T, HV))
    b = rng.standard_normal((B, T, HV))
    A_log = np.log(np.linspace(0.05, 8.0, HV))
    dtb = rng.standard_normal(HV) if dt_bias else None
    return a, b, A_log, dtb


def make_inputs(B, T, H, HV, K, V, *, seed=0, h0=True, seqlens=None, a_max=16.0,
                normalize_qk=True, dht=False):
    """float64 NumPy inputs shaped like a real model's (DESIGN §3). With
    `seqlens`, B must be 1 and T == sum(seqlens); cu_seqlens is returned (int64).
    Returns a dict with q, k, v, g, beta, h0 (or None), cu_seqlens (or None),
    do (upstream gradient of o) and dht (or None)."""
    rng = np.random.default_rng(seed)
    cu = None
    if seqlens is not None:
        assert B == 1 and T == sum(seqlens)
        cu = np.concatenate([[0], np.cumsum(seqlens)]).astype(np.int64)
    N = B if cu is None else len(seqlens)
    q = rng.standard_normal((B, T, H, K))
    k = rng.standard_normal((B, T, H, K))
    if normalize_qk:
        q /= np.linalg.norm(q, axis=-1, keepdims=True)
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, HV, V))
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, HV))))
    softplus = np.log1p(np.exp(0.5 * rng.standard_normal((B, T, HV)) + 1.0))
    g = -decay_rates(HV, a_max)[None, None, :] * softplus
    return dict(
        q=q, k=k, v=v, g=g, beta=beta,
        h0=rng.standard_normal((N, HV, K, V)) * 0.5 if h0 else None,
        cu_seqlens=cu,
        do=rng.standard_normal((B, T, HV, V)),
        dht=rng.standard_normal((N, HV, K, V)) * 0.5 if dht else None,
    )


NP_DTYPES = {"float32": np.float32, "float64": np.float64, "float16": np.float16}


def torch_dtype(name):
    import torch
    return {"float32": torch.float32, "float64": torch.float64,
            "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def cast_inputs_torch(inp, dtype_name, gate_dtype_name="float32", device="cpu"):
    """The inputs as PyTorch tensors: q, k, v, do in dtype; g, beta in
    gate_dtype; states float32 (float64 with float64 inputs); cu_seqlens int64."""
    import torch
    dt = torch_dtype(dtype_name)
    gdt = torch_dtype(gate_dtype_name)
    sdt = torch.float64 if dtype_name == "float64" else torch.float32
    out = {}
    for name, x in inp.items():
        if x is None:
            out[name] = None
        elif name == "cu_seqlens":
            out[name] = torch.as_tensor(x, dtype=torch.int64, device=device)
        elif name in ("g", "beta"):
            out[name] = torch.as_tensor(x, device=device).to(gdt)
        elif name in ("h0", "dht"):
            out[name] = torch.as_tensor(x, device=device).to(sdt)
        else:
            out[name] = torch.as_tensor(x, device=device).to(dt)
    return out


def reference_of(inp, *, use_qk_l2norm=False, scale=None, grads=True):
    """Forward (o, ht) and, if grads, backward gradients of the reference on
    the float64 values of the (possibly rounded) inputs in `inp`."""
    a = {k: to_f64(x) for k, x in inp.items()}
    o, ht = reference.forward(a["q"], a["k"], a["v"], a["g"], a["beta"], scale=scale,
                              initial_state=a["h0"], cu_seqlens=a["cu_seqlens"],
                              use_qk_l2norm=use_qk_l2norm)
    res = {"o": o, "ht": ht}
    if grads:
        g = reference.backward(a["q"], a["k"], a["v"], a["g"], a["beta"], a["do"],
                               dfinal_state=a["dht"], scale=scale, initial_state=a["h0"],
                               cu_seqlens=a["cu_seqlens"], use_qk_l2norm=use_qk_l2norm)
        res.update(zip(GRAD_NAMES, g))
    return res


# ---- direct _C runners on NaN-poisoned outputs (torch tensors, CPU or CUDA)

def pool_prefill_matches_gather(args, pool, idx, cu, layout):
    """flashqla.gdn_chunk through a pool (state=pool, state_indices=idx) against
    gather -> gdn_chunk -> scatter on torch tensors: o and the pool bit for bit
    (asserted here). Returns (o, the pool after, the gathered h0, and the
    gathered call's o and final states)."""
    import torch
    import flashqla
    ok = idx >= 0
    h0 = torch.zeros((idx.numel(),) + tuple(pool.shape[1:]), device=pool.device)
    h0[ok] = pool[idx[ok].long()]
    o_ref, ht = flashqla.gdn_chunk(*args, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                   state_layout=layout)
    want = pool.clone()
    want[idx[ok].long()] = ht[ok]
    got = pool.clone()
    o, none = flashqla.gdn_chunk(*args, state=got, state_indices=idx, cu_seqlens=cu, state_layout=layout)
    if pool.is_cuda:
        torch.cuda.synchronize()
    assert none is None
    assert torch.equal(o, o_ref)
    assert torch.equal(got, want)
    return o, got, h0, o_ref, ht


def _nan_like_torch(x, shape=None, dtype=None):
    import torch
    return torch.full(tuple(x.shape) if shape is None else shape, float("nan"),
                      dtype=x.dtype if dtype is None else dtype, device=x.device)


def c_launch(op, t):
    """stream= and workspace= for a direct _C call on CUDA tensors ({} on CPU)."""
    import torch
    from flashqla import _C
    q, v = t["q"], t["v"]
    if q.device.type != "cuda":
        return {}
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if t.get("cu_seqlens") is None else t["cu_seqlens"].numel() - 1
    n = _C.workspace_bytes(op, B, T, H, HV, K, V, N, str(q.dtype).replace("torch.", ""))
    ws = torch.empty(n, dtype=torch.uint8, device=q.device) if n else None
    return {"stream": torch.cuda.current_stream(q.device).cuda_stream, "workspace": ws}


def c_chunk_fwd(t, *, scale=None, use_qk_l2norm=False, final_state=True):
    """t: dict of torch tensors (cast_inputs_torch). Calls _C.chunk_fwd on
    NaN-filled o / final_state; returns (o, ht or None)."""
    import torch
    from flashqla import _C
    q, v = t["q"], t["v"]
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if t["cu_seqlens"] is None else t["cu_seqlens"].numel() - 1
    sdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    o = _nan_like_torch(v)
    ht = _nan_like_torch(v, (N, HV, K, V), sdt) if final_state else None
    _C.chunk_fwd(q, t["k"], v, t["g"], t["beta"], o,
                 scale=K ** -0.5 if scale is None else scale,
                 initial_state=t["h0"], final_state=ht, cu_seqlens=t["cu_seqlens"],
                 use_qk_l2norm=use_qk_l2norm, **c_launch("fwd", t))
    return o, ht


def c_chunk_bwd(t, *, scale=None, use_qk_l2norm=False):
    """Calls _C.chunk_bwd with do = t['do'] and dfinal_state = t['dht'] on
    NaN-filled gradient buffers; returns dict of gradients (dh0 None without h0)."""
    from flashqla import _C
    q = t["q"]
    K = q.shape[-1]
    d = {
        "dq": _nan_like_torch(q), "dk": _nan_like_torch(t["k"]), "dv": _nan_like_torch(t["v"]),
        "dg": _nan_like_torch(t["g"]), "dbeta": _nan_like_torch(t["beta"]),
        "dh0": None if t["h0"] is None else _nan_like_torch(t["h0"]),
    }
    _C.chunk_bwd(q, t["k"], t["v"], t["g"], t["beta"], t["do"], d["dq"], d["dk"], d["dv"],
                 d["dg"], d["dbeta"], scale=K ** -0.5 if scale is None else scale,
                 initial_state=t["h0"], dfinal_state=t["dht"], dinitial_state=d["dh0"],
                 cu_seqlens=t["cu_seqlens"], use_qk_l2norm=use_qk_l2norm,
                 **c_launch("bwd", t))
    return d


# ---- the CPU test matrix shared by the forward and backward tests
# (name, sizes, options). sizes: B, T, H, HV, K, V (T ignored with seqlens).
# options: dtype, gate (gate dtype, default float32; "same" = dtype), h0,
# l2norm, seqlens, a_max, scale, dht.

def _case(name, B, T, H, HV, K, V, **opts):
    opts.setdefault("dtype", "float32")
    opts.setdefault("gate", "float32")
    opts.setdefault("h0", True)
    opts.setdefault("l2norm", False)
    opts.setdefault("seqlens", None)
    opts.setdefault("a_max", 16.0)
    opts.setdefault("scale", None)
    opts.setdefault("dht", True)
    if opts["gate"] == "same":
        opts["gate"] = opts["dtype"]
    if opts["seqlens"] is not None:
        T = sum(opts["seqlens"])
    return name, (B, T, H, HV, K, V), opts


CPU_CASES = [
    # every dtype (T = 100 crosses a chunk boundary and is not a multiple of 64)
    _case("fp32", 2, 100, 2, 4, 32, 32),
    _case("fp64", 2, 100, 2, 4, 32, 32, dtype="float64", gate="same"),
    _case("bf16", 2, 100, 2, 4, 32, 32, dtype="bfloat16"),
    _case("bf16-gates-bf16", 2, 100, 2, 4, 32, 32, dtype="bfloat16", gate="same"),
    _case("fp16", 2, 100, 2, 4, 32, 32, dtype="float16"),
    _case("fp16-gates-fp16", 1, 100, 2, 4, 32, 32, dtype="float16", gate="same"),
    # GVA ratios 1, 2 (above), 4
    _case("gva1", 2, 77, 2, 2, 32, 32),
    _case("gva4", 1, 77, 1, 4, 32, 32),
    # initial state / l2norm / scale / no dfinal_state
    _case("no-h0", 2, 90, 1, 2, 32, 32, h0=False),
    _case("l2norm", 2, 90, 1, 2, 32, 32, l2norm=True),
    _case("l2norm-no-h0-fp64", 1, 90, 2, 4, 16, 16, l2norm=True, h0=False,
          dtype="float64", gate="same"),
    _case("l2norm-bf16", 1, 90, 2, 4, 32, 32, l2norm=True, dtype="bfloat16"),
    _case("scale-no-dht", 1, 70, 1, 2, 32, 32, scale=0.3, dht=False),
    # decay: none at all over a long-ish sequence, and very strong everywhere
    _case("zero-decay", 1, 300, 1, 2, 32, 32, a_max=0.0),
    _case("strong-decay", 1, 150, 1, 2, 32, 32, a_max=64.0),
    # lengths: a single token, exactly one chunk, two chunks
    _case("T1", 3, 1, 1, 2, 32, 32),
    _case("T64", 1, 64, 1, 2, 32, 32),
    _case("T128-fp64", 1, 128, 1, 2, 16, 16, dtype="float64", gate="same"),
    # head dims
    _case("K64", 1, 80, 1, 2, 64, 64),
    _case("K128", 1, 70, 1, 2, 128, 128),
    _case("K96-V160", 1, 70, 1, 2, 96, 160),
    _case("K16-V48-fp64", 1, 70, 1, 2, 16, 48, dtype="float64", gate="same"),
    # packed variable-length sequences (empty ones included)
    _case("varlen", 1, 0, 1, 2, 32, 32, seqlens=[1, 63, 0, 64, 65, 3]),
    _case("varlen-no-h0-bf16", 1, 0, 2, 4, 32, 32, seqlens=[65, 1, 64, 63], h0=False,
          dtype="bfloat16"),
    _case("varlen-long", 1, 0, 1, 2, 32, 32, seqlens=[1, 63, 64, 65, 1100]),
]

CPU_CASE_IDS = [c[0] for c in CPU_CASES]


def case_inputs(case, seed=0, device="cpu"):
    """(float64 numpy inputs, torch tensors in the case's dtypes)."""
    name, (B, T, H, HV, K, V), o = case
    inp = make_inputs(B, T, H, HV, K, V, seed=seed, h0=o["h0"], seqlens=o["seqlens"],
                      a_max=o["a_max"], normalize_qk=not o["l2norm"], dht=o["dht"])
    return inp, cast_inputs_torch(inp, o["dtype"], o["gate"], device=device)
