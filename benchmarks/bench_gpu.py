#!/usr/bin/env python3
"""Side-by-side GPU benchmark: flashqla vs FLA (flash-linear-attention), one run, one GPU.

Every row of the tables in ANCHORS.md (forward: 12 rows, backward: 5 rows, decode: 6 rows),
inputs exactly as ANCHORS.md states them:

    bf16 q, k, v (q and k L2-normalised per head vector), K = V = 128,
    fp32 g = logsigmoid(randn) / 16 with the first quarter of the value heads g = 0,
    fp32 beta = sigmoid(randn), fp32 h0 given, final state requested.

Timing: one call (or R calls on R input sets, see "rotation") is captured in a CUDA graph;
the graph is replayed, each replay between two CUDA events, after warm-up; the median per
call over --reps replays is reported (host launch overhead excluded, as in the published
tables). If capture fails, eager calls are timed with events instead and the row says so.

Rotation: a row whose data (inputs + outputs + states) is smaller than 4x the L2 cache is
captured as R calls on R independent input sets (R = ceil(4 * L2 / bytes), at most 8), so
that a replay does not find its inputs in L2. Both libraries get the same treatment.

flashqla is called through its extension module flashqla._C (TEAM.md API), outputs and
workspace preallocated: chunk_fwd / chunk_bwd / recurrent. The backward recomputes everything
from the inputs (no saved intermediates cross flashqla's API), so "backward alone given the
forward's context" is one chunk_bwd call. FLA: forward = its public chunk_gated_delta_rule;
backward alone = fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule_bwd given the
forward's saved intermediates (chunk-local cumulative gate and A, from
chunk_gated_delta_rule_fwd), exactly what its autograd backward calls; decode = its
fused_recurrent_gated_delta_rule with fp32 initial state in and final state out.

FLA 0.6.0 refuses its gated backward on Hopper with Triton >= 3.4, < 3.7.1 (guard
fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1, FLA issue #640). The script flips that flag,
checks FLA's gradients (and flashqla's) once against the float64 token-by-token reference
(flashqla/reference.py) on a small case, prints the relative errors, records them, and marks FLA's backward rows if the
check failed.

Usage:
    python3 benchmarks/bench_gpu.py [--rows fwd|bwd|decode|all] [--quick] [--out DIR]
                                    [--dry-run] [--time-budget S] [--fla-warmup-only]
Writes DIR/h200_<date>.json (+ .png) and copies both to $OUT when OUT is set.
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
import traceback
import types

try:  # torch is needed for everything except --dry-run
    import torch
    import torch.nn.functional as F
except Exception:  # pragma: no cover - dry-run on a machine without torch
    torch = None
    F = None

HERE = os.path.dirname(os.path.abspath(__file__))
DEVICE = "cuda"            # a CPU plumbing test may set this to "cpu"

K_DIM = V_DIM = 128
MATMUL_PEAK = 712e12      # bf16 dense, measured on our H200 (ANCHORS.md)
COPY_BW = 4.27e12         # device copy, bytes read + written, measured (ANCHORS.md)
FWD_FLOP = 183e3          # per token and value head, K = V = 128, C = 64 (DESIGN §6)
# Backward: an ESTIMATE, not a measurement: 2.5x the forward. Counting the matrix products
# per 64-token chunk (recompute of W, U and the chunk-start states S: ~6.3 MFLOP; dV local
# 2.1; the reverse state pass dS, dVn 6.3; dQ, dK, dW 9.5; the WY / A transpose 7.3) gives
# ~31.5 MFLOP per chunk = ~490 kFLOP per token and value head = 2.7x; 2.5x is used.
BWD_FLOP = 2.5 * FWD_FLOP
DECODE_FLOP = 7 * K_DIM * V_DIM  # per token and value head: S^T k, the rank-1 update, S^T q


def _load_reference():
    """flashqla/reference.py by path (NumPy only; no built flashqla needed): the project's
    float64 reference and its one tolerance table."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "flashqla_reference", os.path.join(HERE, "..", "flashqla", "reference.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


REFERENCE = _load_reference()
# Tolerances of the one-off check against float64 (bf16 inputs): the project's table.
TOL = {n: REFERENCE.tolerance("bfloat16", n) for n in ("o", "ht", "dq", "dk", "dv", "dbeta", "dh0", "dg")}


def _anchor(fla_ours, fla_pub, flashinfer_pub, flashqla_pub):
    return {"fla_ours": fla_ours, "fla_pub": fla_pub, "flashinfer_pub": flashinfer_pub,
            "flashqla_pub": flashqla_pub}


# layout: "single" one sequence (B = 1, no cu_seqlens); "batch" B equal rows (no cu_seqlens);
# "varlen" B = 1 with cu_seqlens.
FWD_ROWS = [
    dict(H=16, HV=32, seqlens=[32768], layout="single", anchor=_anchor(1.913, 1.890, 1.550, 0.877)),
    dict(H=16, HV=32, seqlens=[8192], layout="single", anchor=_anchor(None, 0.472, 0.394, 0.280)),
    dict(H=16, HV=32, seqlens=[2048], layout="single", anchor=_anchor(0.133, 0.132, 0.106, 0.109)),
    dict(H=16, HV=32, seqlens=[1024] * 8, layout="batch", anchor=_anchor(0.507, 0.501, 0.119, 0.178)),
    dict(H=16, HV=32, seqlens=[4096] * 8, layout="batch", anchor=_anchor(None, 1.914, 0.431, 0.619)),
    dict(H=16, HV=32, seqlens=[16384, 16384], layout="varlen", anchor=_anchor(None, 1.891, 0.778, 0.774)),
    dict(H=16, HV=64, seqlens=[32768], layout="single", anchor=_anchor(None, 3.331, 1.552, 1.521)),
    dict(H=16, HV=64, seqlens=[16384, 16384], layout="varlen", anchor=_anchor(3.436, 3.350, 0.825, 1.196)),
    dict(H=2, HV=8, seqlens=[32768], layout="single", anchor=_anchor(0.904, 0.902, 1.655, 0.320)),
    dict(H=2, HV=8, seqlens=[4096], layout="single", anchor=_anchor(0.132, 0.132, 0.210, 0.087)),
    dict(H=8, HV=32, seqlens=[32768], layout="single", anchor=_anchor(None, 1.885, 1.555, 0.885)),
    dict(H=16, HV=48, seqlens=[32768], layout="single", anchor=_anchor(None, 2.711, 1.557, 1.260)),
]
BWD_ROWS = [
    dict(H=16, HV=32, seqlens=[8192], layout="single", anchor=_anchor(1.483, 1.444, None, 0.789)),
    dict(H=16, HV=32, seqlens=[32768], layout="single", anchor=_anchor(5.853, 5.697, None, 2.515)),
    dict(H=16, HV=32, seqlens=[4096] * 8, layout="batch", anchor=_anchor(5.901, 5.781, None, 2.893)),
    dict(H=4, HV=8, seqlens=[32768], layout="single", anchor=_anchor(2.735, 2.743, None, 0.887)),
    dict(H=2, HV=4, seqlens=[32768], layout="single", anchor=_anchor(2.295, 2.311, None, 0.548)),
]
# Decode: N sequences, T tokens each (B = N rows), fp32 state pool [N, HV, K, V].
DECODE_ROWS = [
    dict(H=16, HV=32, N=1, T=1, anchor={"fla_ours": 0.0032, "floor": 0.0010}),
    dict(H=16, HV=32, N=16, T=1, anchor={"fla_ours": 0.0262, "floor": 0.0157}),
    dict(H=16, HV=32, N=64, T=1, anchor={"fla_ours": 0.0939, "floor": 0.0629}),
    dict(H=16, HV=32, N=256, T=1, anchor={"fla_ours": 0.3647, "floor": 0.2515}),
    dict(H=16, HV=32, N=64, T=4, anchor={"fla_ours": 0.1262, "floor": 0.0629}),
    dict(H=2, HV=8, N=256, T=1, anchor={"fla_ours": 0.0935, "floor": 0.0629}),
]


# ----------------------------------------------------------------------------- models --
def row_geometry(row):
    """B, T, N, total tokens and whether cu_seqlens is used, for a chunk row."""
    seqlens = row["seqlens"]
    if row["layout"] == "batch":
        return dict(B=len(seqlens), T=seqlens[0], N=len(seqlens), tokens=sum(seqlens), varlen=False)
    return dict(B=1, T=sum(seqlens), N=len(seqlens), tokens=sum(seqlens),
                varlen=row["layout"] == "varlen")


def chunk_cost(pass_, H, HV, tokens, N):
    """(FLOPs, minimum bytes) of one call: every input read once, every output written once."""
    K, V = K_DIM, V_DIM
    qk = 2 * tokens * H * K * 2          # q, k (bf16)
    vo = tokens * HV * V * 2             # one [tokens, HV, V] bf16 array
    gates = 2 * tokens * HV * 4          # g, beta (fp32)
    state = N * HV * K * V * 4           # one fp32 state array
    if pass_ == "fwd":
        return FWD_FLOP * tokens * HV, qk + 2 * vo + gates + 2 * state           # q k v g b h0 | o ht
    # bwd: read q k v do g beta h0 dht; write dq dk dv dg dbeta dh0
    return BWD_FLOP * tokens * HV, 2 * qk + 4 * vo + 2 * gates + 3 * state


def decode_cost(H, HV, N, T):
    K, V = K_DIM, V_DIM
    state = N * HV * K * V * 4
    io = N * T * (2 * H * K * 2 + 2 * HV * V * 2 + 2 * HV * 4)
    return DECODE_FLOP * N * T * HV, 2 * state + io


def floor_ms(flops, nbytes):
    return max(flops / MATMUL_PEAK, nbytes / COPY_BW) * 1e3


def row_label(r):
    if r["pass"] == "decode":
        return "dec %d/%d N=%d T=%d" % (r["H"], r["HV"], r["N"], r["T"])
    s = r["seqlens"]
    if r.get("layout") == "varlen":
        seq = "+".join(str(x) for x in s)
    else:
        seq = "%dx%d" % (len(s), s[0])
    return "%s %d/%d %s" % (r["pass"], r["H"], r["HV"], seq)


# -------------------------------------------------------------------------- utilities --
def log(*a):
    print(*a, flush=True)


def short_err(e, n=300):
    s = "%s: %s" % (type(e).__name__, e)
    s = " ".join(s.split())
    return s if len(s) <= n else s[:n] + "..."


def finite_or_none(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def clean_json(obj):
    """Replace NaN/Inf (invalid JSON) by None, recursively."""
    if isinstance(obj, dict):
        return {k: clean_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean_json(v) for v in obj]
    return finite_or_none(obj)


def write_json_atomic(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(clean_json(obj), f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def nvidia_driver():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except Exception:
        return None


def filter_kwargs(fn, kw):
    """Keep only the keyword arguments fn accepts (FLA's internals change between versions)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return kw
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return kw
    return {k: v for k, v in kw.items() if k in params}


def rel_err(out, ref):
    """||out - ref||_2 / ||ref||_2 in float64 (on out's device); inf if out has NaN/Inf."""
    a = out.detach().to(torch.float64)
    b = ref.detach().to(a.device, torch.float64)
    if a.shape != b.shape:
        a = a.reshape(b.shape)
    if not torch.isfinite(a).all():
        return float("inf")
    den = torch.linalg.vector_norm(b).item()
    num = torch.linalg.vector_norm(a - b).item()
    return num / den if den > 0 else num


# ------------------------------------------------------------------------------ inputs --
def l2norm_bf16(x):
    return F.normalize(x.float(), p=2, dim=-1, eps=1e-6).to(torch.bfloat16)


def anchor_gates(B, T, HV, gen, device):
    """fp32 g = logsigmoid(randn)/16 with the first quarter of the value heads 0; beta = sigmoid."""
    g = F.logsigmoid(torch.randn(B, T, HV, generator=gen, device=device)) / 16
    g[:, :, : HV // 4] = 0
    beta = torch.sigmoid(torch.randn(B, T, HV, generator=gen, device=device))
    return g.contiguous(), beta.contiguous()


def strong_gates(B, T, HV, gen, device):
    """DESIGN §3 test gates: g = -A_h softplus(0.5 randn + 1), A_h from 0 to 16."""
    A = torch.linspace(0, 16, HV, device=device)
    g = -A * F.softplus(0.5 * torch.randn(B, T, HV, generator=gen, device=device) + 1)
    beta = torch.sigmoid(torch.randn(B, T, HV, generator=gen, device=device))
    return g.contiguous(), beta.contiguous()


def make_chunk_inputs(H, HV, geo, seqlens, gen, device=None, bwd=False, gates="anchor"):
    device = device or DEVICE
    B, T, N = geo["B"], geo["T"], geo["N"]
    t = types.SimpleNamespace()
    t.B, t.T, t.H, t.HV, t.N = B, T, H, HV, N
    t.q = l2norm_bf16(torch.randn(B, T, H, K_DIM, generator=gen, device=device))
    t.k = l2norm_bf16(torch.randn(B, T, H, K_DIM, generator=gen, device=device))
    t.v = torch.randn(B, T, HV, V_DIM, generator=gen, device=device).to(torch.bfloat16)
    make_g = anchor_gates if gates == "anchor" else strong_gates
    t.g, t.beta = make_g(B, T, HV, gen, device)
    t.h0 = torch.randn(N, HV, K_DIM, V_DIM, generator=gen, device=device)
    t.scale = K_DIM ** -0.5
    if geo["varlen"]:
        cu = [0]
        for s in seqlens:
            cu.append(cu[-1] + s)
        t.cu_list = cu
        t.cu32 = torch.tensor(cu, dtype=torch.int32, device=device)
        t.cu64 = torch.tensor(cu, dtype=torch.int64, device=device)
    else:
        t.cu_list = t.cu32 = t.cu64 = None
    t.ci = None  # FLA chunk_indices, filled by the FLA adapter
    if bwd:
        t.do = torch.randn(B, T, HV, V_DIM, generator=gen, device=device).to(torch.bfloat16)
        t.dht = torch.randn(N, HV, K_DIM, V_DIM, generator=gen, device=device)
    return t


def make_decode_inputs(H, HV, N, T, gen, device=None):
    device = device or DEVICE
    t = types.SimpleNamespace()
    t.B, t.T, t.H, t.HV, t.N = N, T, H, HV, N
    t.q = l2norm_bf16(torch.randn(N, T, H, K_DIM, generator=gen, device=device))
    t.k = l2norm_bf16(torch.randn(N, T, H, K_DIM, generator=gen, device=device))
    t.v = torch.randn(N, T, HV, V_DIM, generator=gen, device=device).to(torch.bfloat16)
    t.g, t.beta = anchor_gates(N, T, HV, gen, device)
    t.state0 = torch.randn(N, HV, K_DIM, V_DIM, generator=gen, device=device)
    t.state = t.state0.clone()           # flashqla's pool, updated in place
    t.indices = torch.arange(N, dtype=torch.int32, device=device)
    t.scale = K_DIM ** -0.5
    return t


def cur_stream():
    return torch.cuda.current_stream().cuda_stream


# --------------------------------------------------------------------------- flashqla --
class Flashqla:
    """flashqla, timed through its public API (api="public", the default):
    gdn_chunk_fwd(...) -> (o, ht, ctx), gdn_chunk_bwd(ctx, do, dht) -> grads, gdn_recurrent;
    or through the extension module with preallocated outputs and workspace (api="c")."""

    def __init__(self, api="public"):
        import flashqla
        self.pkg = flashqla
        C = getattr(flashqla, "_C", None)
        if C is None:
            import importlib
            C = importlib.import_module("flashqla._C")
        self.C = C
        self.api = api
        if api == "public" and not all(hasattr(flashqla, n) for n in
                                       ("gdn_chunk_fwd", "gdn_chunk_bwd", "gdn_recurrent")):
            log("flashqla has no gdn_chunk_fwd/gdn_chunk_bwd/gdn_recurrent: timing flashqla._C instead")
            self.api = "c"
        self.version = getattr(flashqla, "__version__", None)
        self.cuda_built = bool(C.cuda_built())

    def workspace(self, op, B, T, H, HV, N):
        n = int(self.C.workspace_bytes(op, B, T, H, HV, K_DIM, V_DIM, N, "bfloat16"))
        return torch.empty(n, dtype=torch.uint8, device=DEVICE) if n > 0 else None

    # ---- forward: outputs(t) once, then fwd(t, out) per timed call; result(out) = (o, ht)
    def fwd_outputs(self, t):
        if self.api == "public":
            return types.SimpleNamespace(res=None)
        o = torch.full_like(t.v, float("nan"))
        ht = torch.full_like(t.h0, float("nan"))
        return types.SimpleNamespace(o=o, ht=ht, ws=self.workspace("fwd", t.B, t.T, t.H, t.HV, t.N))

    def fwd(self, t, out):
        if self.api == "public":
            out.res = self.pkg.gdn_chunk_fwd(t.q, t.k, t.v, t.g, t.beta, scale=t.scale, initial_state=t.h0,
                                             output_final_state=True, cu_seqlens=t.cu32)
            return
        self.C.chunk_fwd(t.q, t.k, t.v, t.g, t.beta, out.o, scale=t.scale, initial_state=t.h0,
                         final_state=out.ht, cu_seqlens=t.cu32, workspace=out.ws, stream=cur_stream())

    def fwd_result(self, out):
        return (out.res[0], out.res[1]) if self.api == "public" else (out.o, out.ht)

    # ---- backward alone: bwd_outputs(t) runs the forward once for ctx (public API)
    def bwd_outputs(self, t):
        if self.api == "public":
            _, _, ctx = self.pkg.gdn_chunk_fwd(t.q, t.k, t.v, t.g, t.beta, scale=t.scale, initial_state=t.h0,
                                               output_final_state=True, cu_seqlens=t.cu32)
            return types.SimpleNamespace(ctx=ctx, res=None)
        nan = float("nan")
        return types.SimpleNamespace(
            dq=torch.full_like(t.q, nan), dk=torch.full_like(t.k, nan), dv=torch.full_like(t.v, nan),
            dg=torch.full_like(t.g, nan), dbeta=torch.full_like(t.beta, nan),
            dh0=torch.full_like(t.h0, nan), ws=self.workspace("bwd", t.B, t.T, t.H, t.HV, t.N))

    def bwd(self, t, out):
        if self.api == "public":
            out.res = self.pkg.gdn_chunk_bwd(out.ctx, t.do, t.dht)
            return
        self.C.chunk_bwd(t.q, t.k, t.v, t.g, t.beta, t.do, out.dq, out.dk, out.dv, out.dg, out.dbeta,
                         scale=t.scale, initial_state=t.h0, dfinal_state=t.dht,
                         dinitial_state=out.dh0, cu_seqlens=t.cu32, workspace=out.ws,
                         stream=cur_stream())

    def bwd_result(self, out):
        """dict dq, dk, dv, dg, dbeta, dh0."""
        names = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
        if self.api == "public":
            return dict(zip(names, out.res))
        return {n: getattr(out, n) for n in names}

    # ---- decode step: state pool t.state updated in place
    def dec_outputs(self, t):
        if self.api == "public":
            return types.SimpleNamespace(res=None)
        return types.SimpleNamespace(o=torch.full_like(t.v, float("nan")),
                                     ws=self.workspace("recurrent", t.B, t.T, t.H, t.HV, t.N))

    def recurrent(self, t, out):
        if self.api == "public":
            out.res = self.pkg.gdn_recurrent(t.q, t.k, t.v, t.g, t.beta, t.state, state_indices=t.indices,
                                             scale=t.scale)
            return
        self.C.recurrent(t.q, t.k, t.v, t.g, t.beta, t.state, out.o, scale=t.scale,
                         state_indices=t.indices, workspace=out.ws, stream=cur_stream())

    def dec_result(self, out):
        return out.res if self.api == "public" else out.o


# -------------------------------------------------------------------------------- FLA --
class Fla:
    """FLA's Triton path: public forward, internal backward given saved intermediates."""

    GUARD = "fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1"

    def __init__(self):
        # FLA's own Triton kernels, not a backend it may dispatch to (FlashQLA, TileLang).
        os.environ.setdefault("FLA_FLASH_QLA", "0")
        os.environ.setdefault("FLA_TILELANG", "0")
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        self.version = getattr(fla, "__version__", None)
        self.chunk = chunk_gated_delta_rule
        self.fused_recurrent = fused_recurrent_gated_delta_rule
        self.internal_error = None
        try:
            from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd
            self.fwd_internal = chunk_gated_delta_rule_fwd
            self.bwd_internal = chunk_gated_delta_rule_bwd
        except Exception as e:
            self.fwd_internal = self.bwd_internal = None
            self.internal_error = short_err(e)
        try:
            from fla.ops.utils.index import prepare_chunk_indices
            self.prepare_chunk_indices = prepare_chunk_indices
        except Exception:
            self.prepare_chunk_indices = None
        self.guard_module = None
        self.guard_before = None
        try:
            import fla.ops.common.chunk_o as chunk_o
            if hasattr(chunk_o, "TRITON_ABOVE_3_7_1"):
                self.guard_module = chunk_o
                self.guard_before = bool(chunk_o.TRITON_ABOVE_3_7_1)
        except Exception:
            pass
        self.guard_flipped = False
        self.grad_check_ok = None

    def flip_guard(self):
        if self.guard_module is not None and not self.guard_module.TRITON_ABOVE_3_7_1:
            self.guard_module.TRITON_ABOVE_3_7_1 = True
            self.guard_flipped = True

    def prepare(self, t):
        """chunk_indices computed once outside capture (prepare_chunk_indices reads the host)."""
        if t.cu64 is not None and self.prepare_chunk_indices is not None:
            t.ci = self.prepare_chunk_indices(t.cu64, 64)

    def fwd(self, t):
        kw = dict(scale=t.scale, initial_state=t.h0, output_final_state=True)
        if t.cu64 is not None:
            kw.update(cu_seqlens=t.cu64, chunk_indices=t.ci)
        with torch.no_grad():
            return self.chunk(t.q, t.k, t.v, t.g, t.beta, **kw)

    def fwd_saved(self, t):
        """The forward's saved intermediates: (chunk-local cumulative gate, A)."""
        if self.fwd_internal is None:
            raise RuntimeError("FLA internals not importable: %s" % self.internal_error)
        kw = dict(q=t.q, k=t.k, v=t.v, g=t.g, beta=t.beta, scale=t.scale, initial_state=t.h0,
                  output_final_state=True, cu_seqlens=t.cu64, chunk_indices=t.ci)
        with torch.no_grad():
            res = self.fwd_internal(**filter_kwargs(self.fwd_internal, kw))
        g_cum, A = res[0], res[2]
        if tuple(g_cum.shape) != tuple(t.g.shape) or A.shape[:3] != t.v.shape[:3]:
            raise RuntimeError("unexpected chunk_gated_delta_rule_fwd outputs (FLA version?): %s"
                               % [tuple(x.shape) for x in res if hasattr(x, "shape")])
        return g_cum, A

    def bwd(self, t, g_cum, A):
        kw = dict(q=t.q, k=t.k, v=t.v, g=g_cum, beta=t.beta, A=A, scale=t.scale,
                  initial_state=t.h0, do=t.do, dht=t.dht, cu_seqlens=t.cu64, chunk_indices=t.ci)
        with torch.no_grad():
            return self.bwd_internal(**filter_kwargs(self.bwd_internal, kw))  # dq dk dv db dg dh0 ...

    def recurrent(self, t, state):
        with torch.no_grad():
            return self.fused_recurrent(t.q, t.k, t.v, g=t.g, beta=t.beta, scale=t.scale,
                                        initial_state=state, output_final_state=True)


# ----------------------------------------------------------------------------- timing --
def time_calls(fns, reps, warmup=3):
    """Median ms per call of the calls in fns (one per rotated input set).

    Graph capture of all calls, replayed `reps` times between CUDA events; eager fallback.
    Returns dict(ms, ms_min, ms_p90, method)."""
    for _ in range(warmup):            # JIT, Triton autotune, lazy module loading
        for f in fns[: max(1, min(len(fns), 8))]:
            f()
    torch.cuda.synchronize()
    method = "graph"
    graph = None
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for f in fns:
                f()
        torch.cuda.synchronize()
        run = graph.replay
        for _ in range(3):
            run()
        torch.cuda.synchronize()
    except Exception as e:
        graph = None
        method = "eager (graph capture failed: %s)" % short_err(e, 160)
        torch.cuda.synchronize()

        def run():
            for f in fns:
                f()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        run()
        ends[i].record()
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) / len(fns) for s, e in zip(starts, ends))
    del graph
    return dict(ms=statistics.median(ms), ms_min=ms[0], ms_p90=ms[min(len(ms) - 1, int(0.9 * len(ms)))],
                method=method)


def graph_repeats(floor, R, min_ms=0.1):
    """Times the R rotated calls appear in one graph, so that a replay holds >= min_ms of work
    by the floor estimate: for microsecond calls (decode N = 1) the graph launch latency,
    which the start event also sees, is then spread over many calls."""
    return int(max(1, min(64, math.ceil(min_ms / max(floor * R, 1e-6)))))


def rotation_count(nbytes, mode):
    if mode != "auto":
        return max(1, int(mode))
    l2 = 50 << 20
    try:
        l2 = int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", l2)) or l2
    except Exception:
        pass
    return int(min(8, max(1, math.ceil(4 * l2 / max(nbytes, 1)))))


# ------------------------------------------------------------------- reference check --
def float64_reference(t):
    """o, ht and the gradients for <o, do> + <ht, dht>, float64 on the CPU: flashqla/reference.py
    (NumPy, token by token, hand-written reverse mode)."""
    names = ("q", "k", "v", "g", "beta", "h0")
    R = REFERENCE
    x = {n: getattr(t, n).detach().float().cpu().numpy() for n in names}
    do, dht = t.do.float().cpu().numpy(), t.dht.float().cpu().numpy()
    o, ht = R.forward(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=t.scale, initial_state=x["h0"])
    grads = R.backward(x["q"], x["k"], x["v"], x["g"], x["beta"], do, dfinal_state=dht, scale=t.scale,
                       initial_state=x["h0"])
    ref = {"o": o, "ht": ht}
    ref.update(zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads))
    return {n: torch.from_numpy(v) for n, v in ref.items()}, "flashqla/reference.py (float64 NumPy)"


def reference_check(fq, fla, seed=1234):
    """flashqla and FLA against the float64 reference on small cases (H=2, HV=4, T=256).

    Two gate regimes: ANCHORS' (logsigmoid(randn)/16, a quarter of heads 0) and DESIGN §3's
    strong decay (A_h up to 16). Returns a dict of rel errors and pass flags."""
    out = {"shape": "B=1 T=256 H=2 HV=4 K=V=128, bf16 q/k/v, fp32 g/beta/h0, h0 and dht given",
           "tolerances": TOL, "cases": {}}
    for gates in ("anchor", "strong"):
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        geo = dict(B=1, T=256, N=1, tokens=256, varlen=False)
        t = make_chunk_inputs(2, 4, geo, [256], gen, bwd=True, gates=gates)
        ref, out["reference"] = float64_reference(t)
        case = {}
        if fq is not None:
            try:
                fo = fq.fwd_outputs(t)
                fq.fwd(t, fo)
                bo = fq.bwd_outputs(t)
                fq.bwd(t, bo)
                torch.cuda.synchronize()
                got = dict(fq.bwd_result(bo))
                got["o"], got["ht"] = fq.fwd_result(fo)
                case["flashqla"] = {n: rel_err(got[n], ref[n]) for n in TOL}
            except Exception as e:
                case["flashqla"] = {"error": short_err(e)}
        if fla is not None:
            try:
                fla.flip_guard()
                ins = {n: getattr(t, n).detach().clone().requires_grad_(True)
                       for n in ("q", "k", "v", "g", "beta", "h0")}
                o, ht = fla.chunk(ins["q"], ins["k"], ins["v"], ins["g"], ins["beta"], scale=t.scale,
                                  initial_state=ins["h0"], output_final_state=True)
                torch.autograd.backward([o, ht], [t.do, t.dht])
                torch.cuda.synchronize()
                got = {"o": o, "ht": ht, "dq": ins["q"].grad, "dk": ins["k"].grad, "dv": ins["v"].grad,
                       "dg": ins["g"].grad, "dbeta": ins["beta"].grad, "dh0": ins["h0"].grad}
                case["fla"] = {n: (rel_err(got[n], ref[n]) if got[n] is not None else float("inf"))
                               for n in TOL}
            except Exception as e:
                case["fla"] = {"error": short_err(e)}
        for lib in ("flashqla", "fla"):
            if lib in case and "error" not in case[lib]:
                case[lib + "_ok"] = all(case[lib][n] <= TOL[n] for n in TOL)
        out["cases"][gates] = case
    for lib in ("flashqla", "fla"):
        flags = [c.get(lib + "_ok") for c in out["cases"].values()]
        out[lib + "_ok"] = None if any(f is None for f in flags) else all(flags)
    return out


def print_reference_check(rc):
    log("\n== float64 reference check (%s; reference: %s) ==" % (rc["shape"], rc.get("reference")))
    names = list(TOL)
    log("%-8s %-9s " % ("gates", "lib") + " ".join("%9s" % n for n in names) + "  ok")
    log("%-8s %-9s " % ("", "tol") + " ".join("%9.0e" % TOL[n] for n in names))
    for gates, case in rc["cases"].items():
        for lib in ("flashqla", "fla"):
            if lib not in case:
                continue
            r = case[lib]
            if "error" in r:
                log("%-8s %-9s ERROR %s" % (gates, lib, r["error"]))
            else:
                log("%-8s %-9s " % (gates, lib) + " ".join("%9.2e" % r[n] for n in names)
                    + "  " + ("yes" if case.get(lib + "_ok") else "NO"))


# ------------------------------------------------------------------------------ rows --
class Bench:
    def __init__(self, args):
        self.args = args
        self.reps = args.reps if args.reps else (15 if args.quick else 50)
        self.fq = self.fla = None
        self.fq_error = self.fla_error = None
        self.ctx_dead = None
        self.t_start = time.time()

    def out_of_time(self):
        b = self.args.time_budget
        return b and (time.time() - self.t_start) > b

    def setup(self):
        if self.args.fla_warmup_only:
            self.fq_error = "not loaded (--fla-warmup-only)"
        try:
            if self.args.fla_warmup_only:
                raise RuntimeError(self.fq_error)
            self.fq = Flashqla(self.args.api)
            if not self.fq.cuda_built:
                self.fq_error = "flashqla was built without CUDA (_C.cuda_built() is False)"
                log("WARNING:", self.fq_error)
        except Exception as e:
            self.fq_error = short_err(e)
            if not self.args.fla_warmup_only:
                log("flashqla not usable:", self.fq_error)
            self.fq = None
        if not self.args.no_fla:
            try:
                self.fla = Fla()
                if self.fla.internal_error:
                    log("FLA internals not importable (no FLA backward timing):", self.fla.internal_error)
            except Exception as e:
                self.fla_error = short_err(e)
                log("FLA not importable:", self.fla_error)
                self.fla = None
        if self.fla is not None:
            log("FLA %s; backward guard %s = %s before flipping" % (
                self.fla.version, Fla.GUARD,
                self.fla.guard_before if self.fla.guard_module is not None else "not found"))

    def note_error(self, e):
        s = short_err(e)
        low = s.lower()
        if any(x in low for x in ("illegal memory access", "unspecified launch failure",
                                  "device-side assert", "illegal instruction", "misaligned address")):
            self.ctx_dead = s
        return s

    # ---- one chunk row (fwd or bwd) ----
    def run_chunk_row(self, pass_, spec, warmup_only=False):
        H, HV = spec["H"], spec["HV"]
        geo = row_geometry(spec)
        flops, nbytes = chunk_cost(pass_, H, HV, geo["tokens"], geo["N"])
        r = {"pass": pass_, "H": H, "HV": HV, "seqlens": list(spec["seqlens"]), "layout": spec["layout"],
             "B": geo["B"], "N": geo["N"], "tokens": geo["tokens"], "flashqla_ms": None, "fla_ms": None,
             "flop": flops, "bytes": nbytes, "floor_ms": floor_ms(flops, nbytes),
             "flop_model": ("fwd 183 kFLOP/token/value head" if pass_ == "fwd" else
                            "bwd ESTIMATE 2.5 x 183 kFLOP/token/value head"),
             "anchor_ms": spec["anchor"], "errors": {}}
        R = 1 if warmup_only else rotation_count(nbytes, self.args.rotate)
        rep = graph_repeats(r["floor_ms"], R)
        r["rotate"], r["calls_per_graph"] = R, R * rep
        gen = torch.Generator(device=DEVICE).manual_seed(1000 + H * 7 + HV + geo["tokens"])
        sets = [make_chunk_inputs(H, HV, geo, spec["seqlens"], gen, bwd=(pass_ == "bwd")) for _ in range(R)]
        check = {}
        fla_res = None
        # FLA first: its numbers survive if flashqla later breaks the CUDA context.
        if self.fla is not None:
            try:
                for t in sets:
                    self.fla.prepare(t)
                if pass_ == "fwd":
                    fla_res = self.fla.fwd(sets[0])
                    if not warmup_only:
                        tm = time_calls([(lambda t=t: self.fla.fwd(t)) for t in sets] * rep, self.reps)
                else:
                    if self.fla.bwd_internal is None:
                        raise RuntimeError("FLA backward internals missing: %s" % self.fla.internal_error)
                    self.fla.flip_guard()
                    saved = [self.fla.fwd_saved(t) for t in sets]
                    fla_res = self.fla.bwd(sets[0], *saved[0])
                    if not warmup_only:
                        tm = time_calls([(lambda t=t, s=s: self.fla.bwd(t, *s)) for t, s in zip(sets, saved)] * rep,
                                        self.reps)
                    r["fla_grad_check_ok"] = self.fla.grad_check_ok
                torch.cuda.synchronize()
                if not warmup_only:
                    r["fla_ms"], r["fla_ms_min"], r["fla_timing"] = tm["ms"], tm["ms_min"], tm["method"]
            except Exception as e:
                r["errors"]["fla"] = self.note_error(e)
                if self.args.verbose:
                    traceback.print_exc()
        if warmup_only:
            return r
        if self.fq is not None and self.fq.cuda_built and not self.ctx_dead:
            try:
                if pass_ == "fwd":
                    outs = [self.fq.fwd_outputs(t) for t in sets]
                    self.fq.fwd(sets[0], outs[0])
                    torch.cuda.synchronize()
                    o_fq, ht_fq = self.fq.fwd_result(outs[0])
                    if fla_res is not None:
                        check["o_rel_vs_fla"] = rel_err(o_fq, fla_res[0])
                        check["ht_rel_vs_fla"] = rel_err(ht_fq, fla_res[1])
                    else:
                        check["o_finite"] = bool(torch.isfinite(o_fq).all().item())
                    tm = time_calls([(lambda t=t, o=o: self.fq.fwd(t, o)) for t, o in zip(sets, outs)] * rep, self.reps)
                else:
                    outs = [self.fq.bwd_outputs(t) for t in sets]
                    self.fq.bwd(sets[0], outs[0])
                    torch.cuda.synchronize()
                    got = self.fq.bwd_result(outs[0])
                    if fla_res is not None:
                        names = ("dq", "dk", "dv", "dbeta", "dg", "dh0")   # FLA's order: dq dk dv db dg dh0
                        for n, x in zip(names, fla_res[:6]):
                            if x is not None and got.get(n) is not None:
                                check[n + "_rel_vs_fla"] = rel_err(got[n], x)
                    else:
                        check["dq_finite"] = bool(torch.isfinite(got["dq"]).all().item())
                    tm = time_calls([(lambda t=t, o=o: self.fq.bwd(t, o)) for t, o in zip(sets, outs)] * rep, self.reps)
                r["flashqla_ms"], r["flashqla_ms_min"], r["flashqla_timing"] = tm["ms"], tm["ms_min"], tm["method"]
            except Exception as e:
                r["errors"]["flashqla"] = self.note_error(e)
                if self.args.verbose:
                    traceback.print_exc()
        else:
            r["errors"]["flashqla"] = self.fq_unavailable()
        return self.finish_row(r, check)

    # ---- one decode row ----
    def run_decode_row(self, spec, warmup_only=False):
        H, HV, N, T = spec["H"], spec["HV"], spec["N"], spec["T"]
        flops, nbytes = decode_cost(H, HV, N, T)
        r = {"pass": "decode", "H": H, "HV": HV, "seqlens": [T] * N, "N": N, "T": T,
             "flashqla_ms": None, "fla_ms": None, "flop": flops, "bytes": nbytes,
             "floor_ms": floor_ms(flops, nbytes), "flop_model": "decode 7*K*V per token/value head",
             "anchor_ms": spec["anchor"], "errors": {}}
        R = 1 if warmup_only else rotation_count(nbytes, self.args.rotate)
        rep = graph_repeats(r["floor_ms"], R)
        r["rotate"], r["calls_per_graph"] = R, R * rep
        gen = torch.Generator(device=DEVICE).manual_seed(2000 + N * 3 + T + HV)
        sets = [make_decode_inputs(H, HV, N, T, gen) for _ in range(R)]
        check = {}
        fla_res = None
        if self.fla is not None:
            try:
                fla_res = self.fla.recurrent(sets[0], sets[0].state0)
                torch.cuda.synchronize()
                if not warmup_only:
                    tm = time_calls([(lambda t=t: self.fla.recurrent(t, t.state0)) for t in sets] * rep, self.reps)
                    r["fla_ms"], r["fla_ms_min"], r["fla_timing"] = tm["ms"], tm["ms_min"], tm["method"]
            except Exception as e:
                r["errors"]["fla"] = self.note_error(e)
        if warmup_only:
            return r
        if self.fq is not None and self.fq.cuda_built and not self.ctx_dead:
            try:
                outs = [self.fq.dec_outputs(t) for t in sets]
                self.fq.recurrent(sets[0], outs[0])       # state was state0: one step from state0
                torch.cuda.synchronize()
                if fla_res is not None:
                    check["o_rel_vs_fla"] = rel_err(self.fq.dec_result(outs[0]), fla_res[0])
                    check["state_rel_vs_fla"] = rel_err(sets[0].state, fla_res[1])
                tm = time_calls([(lambda t=t, o=o: self.fq.recurrent(t, o)) for t, o in zip(sets, outs)] * rep, self.reps)
                r["flashqla_ms"], r["flashqla_ms_min"], r["flashqla_timing"] = tm["ms"], tm["ms_min"], tm["method"]
            except Exception as e:
                r["errors"]["flashqla"] = self.note_error(e)
        else:
            r["errors"]["flashqla"] = self.fq_unavailable()
        return self.finish_row(r, check)

    def fq_unavailable(self):
        """Why a row has no flashqla time: the CUDA context was lost, or flashqla is not usable."""
        if self.ctx_dead:
            return "skipped: CUDA context lost earlier (%s)" % self.ctx_dead
        return self.fq_error or "flashqla not available"

    def finish_row(self, r, check):
        r["check"] = check
        self.derive(r)
        return r

    @staticmethod
    def derive(r):
        derive_metrics(r)


def derive_metrics(r):
    fq, fl = r.get("flashqla_ms"), r.get("fla_ms")
    r["tflops"] = r["flop"] / (fq * 1e-3) / 1e12 if fq else None
    r["fla_tflops"] = r["flop"] / (fl * 1e-3) / 1e12 if fl else None
    r["pct_floor"] = 100.0 * r["floor_ms"] / fq if fq else None
    r["ratio"] = fl / fq if (fq and fl) else None
    pub = (r.get("anchor_ms") or {}).get("flashqla_pub")
    r["flashqla_pub_over_ours"] = pub / fq if (pub and fq) else None
    ours = (r.get("anchor_ms") or {}).get("fla_ours") or (r.get("anchor_ms") or {}).get("fla_pub")
    r["fla_vs_anchor"] = fl / ours if (fl and ours) else None


# ---------------------------------------------------------------------------- output --
def fmt(x, f="%.3f", none="-"):
    return none if x is None else f % x


def check_summary(r):
    c = r.get("check") or {}
    vals = [(k.replace("_rel_vs_fla", ""), v) for k, v in c.items() if k.endswith("_rel_vs_fla")]
    if not vals:
        return "-"
    worst_k, worst = max(vals, key=lambda kv: kv[1] if kv[1] is not None else float("inf"))
    limit = 2e-2 if r["pass"] in ("fwd", "decode") else 4e-2
    flag = "ok" if (worst is not None and worst <= limit) else "MISMATCH"
    return "%s max %s %.1e" % (flag, worst_k, worst if worst is not None else float("nan"))


def graph_shape(r):
    R, n = r.get("rotate"), r.get("calls_per_graph")
    return "%dx%d" % (R, n // R) if (R and n) else ("%s" % R if R else "-")


def print_table(rows):
    log("\n%-28s %9s %8s %7s %9s %8s %7s %8s  %s" % (
        "row", "fq ms", "TFLOP/s", "%floor", "FLA ms", "FLA/fq", "pub/fq", "sets x n", "check vs FLA / errors"))
    for r in rows:
        err = "; ".join("%s: %s" % kv for kv in (r.get("errors") or {}).items())
        log("%-28s %9s %8s %7s %9s %8s %7s %8s  %s%s" % (
            row_label(r), fmt(r.get("flashqla_ms"), "%.4f"), fmt(r.get("tflops"), "%.1f"),
            fmt(r.get("pct_floor"), "%.0f%%"), fmt(r.get("fla_ms"), "%.4f"), fmt(r.get("ratio"), "%.2f"),
            fmt(r.get("flashqla_pub_over_ours"), "%.2f"), graph_shape(r), check_summary(r),
            ("  [" + err[:200] + "]") if err else ""))


def ratio_table(rows):
    lines = ["", "=== FLA / flashqla (>= 1.0 required by issue 3; pub/fq = FlashQLA published / flashqla) ==="]
    for r in rows:
        lines.append("%-28s fq %9s ms  FLA %9s ms  FLA/fq %6s  pub/fq %5s" % (
            row_label(r), fmt(r.get("flashqla_ms"), "%.4f"), fmt(r.get("fla_ms"), "%.4f"),
            fmt(r.get("ratio"), "%.2f"), fmt(r.get("flashqla_pub_over_ours"), "%.2f")))
    for p in ("fwd", "bwd", "decode"):
        rs = [r["ratio"] for r in rows if r["pass"] == p and r.get("ratio") is not None]
        n = sum(1 for r in rows if r["pass"] == p)
        if n:
            lines.append("%-6s rows %2d, measured %2d, min ratio %s, below 1.0: %d" % (
                p, n, len(rs), fmt(min(rs) if rs else None, "%.2f"), sum(1 for x in rs if x < 1.0)))
    return "\n".join(lines)


def result_paths(out_dir, gpu_name, date, dry):
    slug = "dryrun" if dry else ("h200" if "H200" in (gpu_name or "") else
                                 "".join(c if c.isalnum() else "_" for c in (gpu_name or "gpu").lower()).strip("_"))
    base = os.path.join(out_dir, "%s_%s" % (slug, date))
    return base + ".json", base + ".png"


def finish(results, json_path, png_path, table_file, write=True):
    if write:
        write_json_atomic(json_path, results)
        log("\nwrote", json_path)
    try:
        sys.path.insert(0, HERE)
        import plot
        plot.plot_results(json_path, png_path)
        log("wrote", png_path)
    except Exception as e:
        log("plot failed:", short_err(e))
    out = os.environ.get("OUT")
    if out:
        try:
            os.makedirs(out, exist_ok=True)
            for p in (json_path, png_path):
                if os.path.exists(p):
                    shutil.copy(p, out)
            log("copied results to", out)
        except Exception as e:
            log("copy to $OUT failed:", short_err(e))
    print_table(results["rows"])
    table = ratio_table(results["rows"])
    if table_file:
        try:
            with open(table_file, "w") as f:
                f.write(table + "\n")
        except Exception as e:
            log("table file:", short_err(e))
    log(table)


# --------------------------------------------------------------------------- dry run --
def dry_run(args):
    """Fake timings (anchors times noise) through the same JSON / table / plot code."""
    rng = random.Random(7)
    date = datetime.date.today().isoformat()
    rows = []
    for pass_, specs in (("fwd", FWD_ROWS), ("bwd", BWD_ROWS), ("decode", DECODE_ROWS)):
        if args.rows not in ("all", pass_):
            continue
        for spec in specs:
            if pass_ == "decode":
                flops, nbytes = decode_cost(spec["H"], spec["HV"], spec["N"], spec["T"])
                r = {"pass": "decode", "H": spec["H"], "HV": spec["HV"], "seqlens": [spec["T"]] * spec["N"],
                     "N": spec["N"], "T": spec["T"], "anchor_ms": spec["anchor"]}
                fla = spec["anchor"]["fla_ours"]
            else:
                geo = row_geometry(spec)
                flops, nbytes = chunk_cost(pass_, spec["H"], spec["HV"], geo["tokens"], geo["N"])
                r = {"pass": pass_, "H": spec["H"], "HV": spec["HV"], "seqlens": list(spec["seqlens"]),
                     "layout": spec["layout"], "B": geo["B"], "N": geo["N"], "tokens": geo["tokens"],
                     "anchor_ms": spec["anchor"]}
                a = spec["anchor"]
                fla = a["fla_ours"] or a["fla_pub"]
            r.update(flop=flops, bytes=nbytes, floor_ms=floor_ms(flops, nbytes), rotate=1, errors={},
                     fla_ms=fla * rng.uniform(0.97, 1.03), flashqla_ms=fla / rng.uniform(0.6, 4.0),
                     check={"o_rel_vs_fla": rng.uniform(1e-3, 6e-3)}, fake=True)
            if rng.random() < 0.1:          # exercise the null path
                r["flashqla_ms"] = None
                r["errors"]["flashqla"] = "RuntimeError: fake failure (dry run)"
            derive_metrics(r)
            rows.append(r)
    results = {"gpu": "DRY RUN (fake numbers)", "date": date,
               "versions": {"flashqla": None, "torch": getattr(torch, "__version__", None),
                            "triton": None, "fla": None, "cuda": None, "driver": None},
               "dry_run": True, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    json_path, png_path = result_paths(args.out, results["gpu"], date, True)
    finish(results, json_path, png_path, args.table_file)
    return 0


# ------------------------------------------------------------------------------ main --
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", choices=("fwd", "bwd", "decode", "all"), default="all")
    p.add_argument("--quick", action="store_true", help="15 replays per timing instead of 50")
    p.add_argument("--reps", type=int, default=0, help="replays per timing (overrides --quick)")
    p.add_argument("--out", default=os.path.join(HERE, "results"), help="directory for JSON + PNG")
    p.add_argument("--dry-run", action="store_true", help="fake timings; tests JSON/table/plot here")
    p.add_argument("--rotate", default="auto", help="input sets per timed graph: auto or an integer")
    p.add_argument("--time-budget", type=float, default=0.0,
                   help="seconds; rows that would start later are skipped (0: no limit)")
    p.add_argument("--no-fla", action="store_true", help="flashqla only")
    p.add_argument("--api", choices=("public", "c"), default="public",
                   help="time flashqla through gdn_chunk_fwd/gdn_chunk_bwd/gdn_recurrent (public) or "
                        "through flashqla._C with preallocated outputs and workspace (c)")
    p.add_argument("--no-check", action="store_true", help="skip the float64 reference check")
    p.add_argument("--fla-warmup-only", action="store_true",
                   help="run each FLA call once (Triton compile + autotune into the on-disk cache), no timing")
    p.add_argument("--table-file", default=None, help="also write the ratio table to this file")
    p.add_argument("--path-file", default=None, help="write the results JSON's path to this file first")
    p.add_argument("--from-json", default=None, metavar="PATH",
                   help="no timing: re-plot and re-print the tables of an existing results JSON")
    p.add_argument("--max-rows", type=int, default=0, help="at most this many rows per pass (testing)")
    p.add_argument("--verbose", action="store_true", help="print tracebacks")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            results = json.load(f)
        for r in results.get("rows", []):
            if "flop" in r and "ratio" not in r:
                derive_metrics(r)
        finish(results, args.from_json, os.path.splitext(args.from_json)[0] + ".png", args.table_file, write=False)
        return 0
    if args.dry_run:
        return dry_run(args)
    if torch is None or not torch.cuda.is_available():
        log("bench_gpu: no CUDA device visible to torch; nothing to time (use --dry-run to test plumbing)")
        return 2
    torch.manual_seed(0)
    stream = torch.cuda.Stream()       # never the legacy default stream (DLPack stream 0 is invalid)
    with torch.cuda.stream(stream):
        return run(args)


def blank_row(pass_, spec, errors):
    """A row without timings (skipped, or failed before timing)."""
    r = {"pass": pass_, "H": spec["H"], "HV": spec["HV"], "flashqla_ms": None, "fla_ms": None,
         "errors": errors}
    if pass_ == "decode":
        r.update(seqlens=[spec["T"]] * spec["N"], N=spec["N"], T=spec["T"])
    else:
        r.update(seqlens=list(spec["seqlens"]), layout=spec["layout"])
    return r


def run(args):
    date = datetime.date.today().isoformat()
    gpu = torch.cuda.get_device_name()
    b = Bench(args)
    log("bench_gpu: %s, torch %s, CUDA %s, replays %d" % (gpu, torch.__version__, torch.version.cuda, b.reps))
    b.setup()
    triton_v = None
    try:
        import triton
        triton_v = triton.__version__
    except Exception:
        pass
    results = {"gpu": gpu, "date": date,
               "versions": {"flashqla": b.fq.version if b.fq else None, "torch": torch.__version__,
                            "triton": triton_v, "fla": b.fla.version if b.fla else None,
                            "cuda": torch.version.cuda, "driver": nvidia_driver()},
               "method": ("CUDA-graph replays between CUDA events, median of %d after warm-up, per call; "
                          "R input sets per graph when data < 4x L2 (row key 'rotate'), each repeated so "
                          "a replay holds >= 0.1 ms of floor-estimated work (key 'calls_per_graph')" % b.reps),
               "fla_backward": ("fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule_bwd given "
                                "chunk_gated_delta_rule_fwd's (g_cumsum, A); guard %s flipped" % Fla.GUARD),
               "flashqla_api": (b.fq.api if b.fq else None),
               "flashqla_error": b.fq_error, "fla_error": b.fla_error, "rows": []}
    os.makedirs(args.out, exist_ok=True)
    json_path, png_path = result_paths(args.out, gpu, date, False)
    if args.path_file:                      # tells gpu_check.sh where a partial JSON is
        try:
            with open(args.path_file, "w") as f:
                f.write(json_path + "\n")
        except Exception as e:
            log("path file:", short_err(e))

    plan = []
    for pass_, specs in (("fwd", FWD_ROWS), ("bwd", BWD_ROWS), ("decode", DECODE_ROWS)):
        if args.rows in ("all", pass_):
            plan += [(pass_, s) for s in (specs[: args.max_rows] if args.max_rows else specs)]

    if args.fla_warmup_only:
        if b.fla is None:
            log("FLA not available: nothing to warm up")
            return 1
        b.fla.flip_guard()
        for pass_, spec in plan:
            t0 = time.time()
            try:
                r = b.run_decode_row(spec, True) if pass_ == "decode" else b.run_chunk_row(pass_, spec, True)
                log("warm-up %-28s %6.1f s %s" % (row_label(r), time.time() - t0, r["errors"] or ""))
            except Exception as e:
                log("warm-up %s failed: %s" % (pass_, short_err(e)))
            torch.cuda.empty_cache()
        return 0

    if not args.no_check and (b.fq is not None or b.fla is not None):
        t0 = time.time()
        try:
            rc = reference_check(b.fq if (b.fq and b.fq.cuda_built) else None, b.fla)
            if b.fla is not None:
                b.fla.grad_check_ok = rc.get("fla_ok")
            results["reference_check"] = rc
            print_reference_check(rc)
            if b.fla is not None and rc.get("fla_ok") is False:
                log("WARNING: FLA's gradients miss DESIGN §3's tolerances here (see the table; the "
                    "Triton miscompile of FLA #640 shows as errors of order 1): its backward rows are "
                    "timed but marked fla_grad_check_ok = false")
        except Exception as e:
            results["reference_check"] = {"error": b.note_error(e)}
            log("reference check failed:", short_err(e))
            if args.verbose:
                traceback.print_exc()
        log("reference check took %.1f s" % (time.time() - t0))

    for pass_, spec in plan:
        label = row_label(dict(spec, **{"pass": pass_}))
        if b.out_of_time():
            results["rows"].append(blank_row(pass_, spec, {"skipped": "time budget"}))
            log("%-28s skipped (time budget %.0f s)" % (label, args.time_budget))
            continue
        t0 = time.time()
        try:
            r = b.run_decode_row(spec) if pass_ == "decode" else b.run_chunk_row(pass_, spec)
        except Exception as e:   # input construction, OOM, ...
            r = blank_row(pass_, spec, {"row": b.note_error(e)})
            if args.verbose:
                traceback.print_exc()
        r["wall_s"] = round(time.time() - t0, 1)
        results["rows"].append(r)
        write_json_atomic(json_path, results)          # partial results survive a kill
        log("%-28s fq %s ms  FLA %s ms (%sx ANCHORS)  ratio %s  %%floor %s  [%s]  (%.1f s)%s" % (
            label, fmt(r.get("flashqla_ms"), "%.4f"), fmt(r.get("fla_ms"), "%.4f"), fmt(r.get("fla_vs_anchor"), "%.2f"),
            fmt(r.get("ratio"), "%.2f"), fmt(r.get("pct_floor"), "%.0f"),
            check_summary(r) if "check" in r else "-", r["wall_s"],
            ("  errors: %s" % r["errors"]) if r.get("errors") else ""))
        try:
            torch.cuda.empty_cache()
        except Exception:
            pass

    finish(results, json_path, png_path, args.table_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
