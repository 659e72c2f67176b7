#!/usr/bin/env python3
"""Side-by-side GPU benchmark: flashqla, QwenLM's FlashQLA 0.1.3 and FLA 0.6.0, one run, one GPU.

Three libraries, each through its public PyTorch call:

    flashqla   (this project)  gdn_chunk / gdn_chunk_fwd + gdn_chunk_bwd / gdn_recurrent
    FlashQLA   (flash_qla)     flash_qla.chunk_gated_delta_rule, its backward
                               flash_qla.chunk_gated_delta_rule_bwd (TileLang, JIT-compiled)
    FLA        (fla)           fla.ops.gated_delta_rule.chunk_gated_delta_rule (Triton), timed in a
                               separate process started with FLA_DISABLE_BACKEND_DISPATCH=1: FLA 0.6.0
                               otherwise hands chunk_gated_delta_rule to FlashQLA when it is importable

flashqla and FlashQLA run in this process, side by side on the same inputs; FLA's process times the
same rows on the same inputs (same seeds) afterwards, with the time left.

Passes and rows (ANCHORS.md):
    fwd     the 12 forward rows; an inference forward: torch.no_grad(), no input requires grad
    bwd     the backward alone, given each library's saved forward context (5 rows):
            flashqla gdn_chunk_bwd(ctx, do, dht) with ctx from gdn_chunk_fwd; FlashQLA
            chunk_gated_delta_rule_bwd(...) with the saved tensors, cp_context and cp_cache of its
            autograd forward (what its autograd backward calls); FLA chunk_gated_delta_rule_bwd given
            chunk_gated_delta_rule_fwd's (chunk-local cumulative gate, A)
    train   forward + backward through each library's autograd, as a training step runs it (5 rows):
            o, ht = lib(q, k, v, g, beta, initial_state=h0, ...) with every input requiring grad, then
            torch.autograd.grad([o, ht], inputs, [do, dht]) (= loss.backward() for
            loss = <o, do> + <ht, dht>, without the loss's own elementwise kernels and without
            accumulating into .grad)
    decode  the recurrent step, 10 rows (flashqla and FLA; FlashQLA has none): flashqla on a
            pool with state_indices (serving), and, like FLA's fused_recurrent, which has no
            indices, on the states themselves ("noidx": slot n for sequence n, no index load)

Inputs for every chunk row: bf16 q, k, v (q and k L2-normalised per head vector), K = V = 128,
fp32 g = logsigmoid(randn) / 16 with the first quarter of the value heads g = 0, fp32 beta =
sigmoid(randn), fp32 h0 given, final state requested; "8x4096" is B = 8 rows without cu_seqlens,
"16384+16384" is B = 1 with cu_seqlens [0, 16384, 32768] (int32 for all three libraries' calls;
FLA gets int64 as its API states). Backward and training: bf16 dO and fp32 dht random.

Timing: one call (or R calls on R input sets, see "rotation") is captured in a CUDA graph; the
graph is replayed, each replay between two CUDA events, after warm-up; the median per call over
--reps replays is reported (host launch overhead excluded, as in the published tables). If capture
fails, eager calls are timed with events instead and the row says so (key *_timing).
Rotation: a row whose data is under 4x the L2 cache runs R = ceil(4 L2 / bytes) <= 8 input sets
per graph, so that a replay does not find its inputs in L2; every library gets the same treatment.

Memory (fwd and train rows, key peak_extra_mib): peak device memory allocated during one warm
eager call (torch.cuda.reset_peak_memory_stats / max_memory_allocated) minus what was allocated
before it (the inputs) minus the bytes of the call's outputs (o, ht; and the six gradients for
train): the library's scratch and saved context.

JIT: FlashQLA compiles each kernel on first use (TileLang, ~5-25 s a kernel, cached on disk in
TILELANG_CACHE_DIR). Per row the harness reports the wall time of FlashQLA's first calls
(flash_qla_jit_s, compile included) and the number of kernels it compiled (flash_qla_new_kernels,
new entries in the disk cache), apart from the timing. A carried cache built ahead of time
(benchmarks/prebuild_flashqla_cache.py) makes both zero.

Correctness: each library is checked once against the float64 token-by-token reference
(flashqla/reference.py, B = 1, T = 256, H = 2, HV = 4, anchor gates and strong decay) on the
outputs and all gradients (key reference_check); per row flashqla's outputs are compared with
FlashQLA's (key check: relative differences, a sanity check, not the accuracy test).

FLA 0.6.0 refuses its gated backward on Hopper with Triton >= 3.4, < 3.7.1 (FLA issue #640); FLA's
process flips fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1, and its reference check records whether
its gradients then meet the project's tolerances (fla_grad_check_ok on bwd/train rows).

Usage:
    python3 benchmarks/bench_gpu.py [--rows fwd|bwd|train|decode|verify|all|fwd,train...] [--quick]
        [--time-budget S] [--no-fla] [--no-flash-qla] [--out DIR] [--table-file F] [--dry-run]
Writes DIR/h200_<date>.json (+ .png), rewritten after every row (a run stopped by the time budget
or killed keeps what it measured), copies both to $OUT when OUT is set, and prints the table LAST.
--dry-run: fake numbers through the same JSON / table / plot / FLA-process code (no GPU needed).
"""
from __future__ import annotations

import argparse
import datetime
import glob
import inspect
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
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
DEVICE = "cuda"

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
FLOOR_RATIO = 1.15        # issues 7 and 8: flash_qla_ms / flashqla_ms >= 1.15 on every row
FLA_ENV = {"FLA_DISABLE_BACKEND_DISPATCH": "1", "FLA_FLASH_QLA": "0", "FLA_TILELANG": "0"}
LIBS = ("flashqla", "flash_qla", "fla")


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
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def _anchor(fla_ours, fla_pub, flashinfer_pub, flashqla_pub, sbs_flashqla=None, sbs_flash_qla=None):
    """ANCHORS.md numbers (ms): FLA re-measured / published, FlashInfer and FlashQLA published;
    sbs_*: the side-by-side measurement of 2026-12-01 (flashqla at e11596d, FlashQLA 0.1.3)."""
    return {"fla_ours": fla_ours, "fla_pub": fla_pub, "flashinfer_pub": flashinfer_pub,
            "flashqla_pub": flashqla_pub, "sbs_flashqla": sbs_flashqla, "sbs_flash_qla": sbs_flash_qla}


# layout: "single" one sequence (B = 1, no cu_seqlens); "batch" B equal rows (no cu_seqlens);
# "varlen" B = 1 with cu_seqlens.
FWD_ROWS = [
    dict(H=16, HV=32, seqlens=[32768], layout="single", anchor=_anchor(1.913, 1.890, 1.550, 0.877, 1.852, 1.243)),
    dict(H=16, HV=32, seqlens=[8192], layout="single", anchor=_anchor(None, 0.472, 0.394, 0.280, 0.470, 0.303)),
    dict(H=16, HV=32, seqlens=[2048], layout="single", anchor=_anchor(0.133, 0.132, 0.106, 0.109, 0.133, 0.088)),
    dict(H=16, HV=32, seqlens=[1024] * 8, layout="batch", anchor=_anchor(0.507, 0.501, 0.119, 0.178, 0.438, 0.185)),
    dict(H=16, HV=32, seqlens=[4096] * 8, layout="batch", anchor=_anchor(None, 1.914, 0.431, 0.619, 1.693, 0.643)),
    dict(H=16, HV=32, seqlens=[16384, 16384], layout="varlen", anchor=_anchor(None, 1.891, 0.778, 0.774, 1.671, 0.776)),
    dict(H=16, HV=64, seqlens=[32768], layout="single", anchor=_anchor(None, 3.331, 1.552, 1.521, 3.287, 1.523)),
    dict(H=16, HV=64, seqlens=[16384, 16384], layout="varlen", anchor=_anchor(3.436, 3.350, 0.825, 1.196, 3.327, 1.252)),
    dict(H=2, HV=8, seqlens=[32768], layout="single", anchor=_anchor(0.904, 0.902, 1.655, 0.320, 0.850, 0.394)),
    dict(H=2, HV=8, seqlens=[4096], layout="single", anchor=_anchor(0.132, 0.132, 0.210, 0.087, 0.120, 0.133)),
    dict(H=8, HV=32, seqlens=[32768], layout="single", anchor=_anchor(None, 1.885, 1.555, 0.885, 1.806, 1.235)),
    dict(H=16, HV=48, seqlens=[32768], layout="single", anchor=_anchor(None, 2.711, 1.557, 1.260, 2.631, 1.409)),
]
# The backward table of ANCHORS.md; the "bwd" and the "train" pass both run these shapes.
BWD_ROWS = [
    dict(H=16, HV=32, seqlens=[8192], layout="single", anchor=_anchor(1.483, 1.444, None, 0.789)),
    dict(H=16, HV=32, seqlens=[32768], layout="single", anchor=_anchor(5.853, 5.697, None, 2.515)),
    dict(H=16, HV=32, seqlens=[4096] * 8, layout="batch", anchor=_anchor(5.901, 5.781, None, 2.893)),
    dict(H=4, HV=8, seqlens=[32768], layout="single", anchor=_anchor(2.735, 2.743, None, 0.887)),
    dict(H=2, HV=4, seqlens=[32768], layout="single", anchor=_anchor(2.295, 2.311, None, 0.548)),
]
TRAIN_ANCHORS = {  # ANCHORS.md side by side, training step (fwd + bwd through autograd)
    (16, 32, (8192,)): _anchor(None, None, None, None, 1.894, 0.996),
    (16, 32, (32768,)): _anchor(None, None, None, None, 7.270, 3.564),
}
# Decode: N sequences, T tokens each (B = N rows), fp32 state pool [N, HV, K, V].
DECODE_ROWS = [
    dict(H=16, HV=32, N=1, T=1, anchor={"fla_ours": 0.0032, "floor": 0.0010}),
    dict(H=16, HV=32, N=16, T=1, anchor={"fla_ours": 0.0262, "floor": 0.0157}),
    dict(H=16, HV=32, N=64, T=1, anchor={"fla_ours": 0.0939, "floor": 0.0629}),
    dict(H=16, HV=32, N=256, T=1, anchor={"fla_ours": 0.3647, "floor": 0.2515}),
    dict(H=16, HV=32, N=64, T=4, anchor={"fla_ours": 0.1262, "floor": 0.0629}),
    dict(H=2, HV=8, N=256, T=1, anchor={"fla_ours": 0.0935, "floor": 0.0629}),
    # issue 11: the vLLM / FlashInfer pool layout [N, HV, V, K] (FLA: state_v_first=True)
    dict(H=16, HV=32, N=1, T=1, state_layout="vk", anchor={}),
    dict(H=16, HV=32, N=64, T=1, state_layout="vk", anchor={}),
    # the anchor rows' own call: states in and out without a pool index (FLA has none), so
    # that flashqla's column does no more than FLA's (no dependent index load first)
    dict(H=16, HV=32, N=1, T=1, indices=False, anchor={"fla_ours": 0.0032, "floor": 0.0010}),
    dict(H=16, HV=32, N=64, T=1, indices=False, anchor={"fla_ours": 0.0939, "floor": 0.0629}),
]
# issue 11, speculative verify (MTP): T draft tokens per sequence, the state after each written
# to an intermediate buffer [N, T, HV, K, V], the pool untouched (update_state=False). FLA 0.6.0's
# fused_recurrent returns no intermediate states: its column is the same T tokens with the
# final state only. Floor: the pool read once + T states written + the token inputs/outputs.
VERIFY_ROWS = [
    dict(H=16, HV=32, N=1, T=4, anchor={}),
    dict(H=16, HV=32, N=16, T=4, anchor={}),
    dict(H=16, HV=32, N=64, T=4, anchor={"fla_ours": 0.1262}),
]
# issue 11, fused-gate prefill: g, beta are the raw a, b [B, T, HV] and the kernels compute
# g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) (FLA 0.6.0's use_gate_in_kernel and
# use_beta_sigmoid_in_kernel; FLA timed with the same options; FlashQLA has no fused gates).
FWD_ROWS += [
    dict(H=16, HV=32, seqlens=[8192], layout="single", gates="fused", anchor=_anchor(None, None, None, None)),
    dict(H=16, HV=32, seqlens=[32768], layout="single", gates="fused", anchor=_anchor(None, None, None, None)),
    dict(H=16, HV=32, seqlens=[1024] * 8, layout="batch", gates="fused", anchor=_anchor(None, None, None, None)),
]
PASSES = ("fwd", "bwd", "train", "decode", "verify")
# The float64 reference check's shape (also JIT-compiled by FlashQLA: prebuilt with the rows).
CHECK_SHAPE = dict(H=2, HV=4, seqlens=[256], layout="single")


def row_anchor(pass_, spec):
    if pass_ == "train":
        return TRAIN_ANCHORS.get((spec["H"], spec["HV"], tuple(spec["seqlens"])), _anchor(None, None, None, None))
    return spec["anchor"]


def plan_rows(rows_arg, max_rows=0):
    """[(pass, spec)] in run order: the forward rows, then per backward shape its "bwd" and its
    "train" row (they need the same FlashQLA kernels), then decode. rows_arg: "all" or a
    comma-separated subset of fwd, bwd, train, decode."""
    want = set(PASSES) if rows_arg == "all" else {p.strip() for p in rows_arg.split(",") if p.strip()}
    bad = want - set(PASSES)
    if bad:
        raise ValueError("--rows: unknown pass %s (choose from %s or all)" % (sorted(bad), ", ".join(PASSES)))
    cut = (lambda xs: xs[:max_rows]) if max_rows else (lambda xs: xs)
    plan = [("fwd", s) for s in cut(FWD_ROWS)] if "fwd" in want else []
    for s in cut(BWD_ROWS):
        plan += [(p, s) for p in ("bwd", "train") if p in want]
    if "decode" in want:
        plan += [("decode", s) for s in cut(DECODE_ROWS)]
    if "verify" in want:
        plan += [("verify", s) for s in cut(VERIFY_ROWS)]
    return plan


# ----------------------------------------------------------------------------- models --
def row_geometry(spec):
    """B, T, N, total tokens and whether cu_seqlens is used, for a chunk row."""
    seqlens = spec["seqlens"]
    if spec["layout"] == "batch":
        return dict(B=len(seqlens), T=seqlens[0], N=len(seqlens), tokens=sum(seqlens), varlen=False)
    return dict(B=1, T=sum(seqlens), N=len(seqlens), tokens=sum(seqlens),
                varlen=spec["layout"] == "varlen")


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
    flops, nbytes = BWD_FLOP * tokens * HV, 2 * qk + 4 * vo + 2 * gates + 3 * state
    if pass_ == "train":                 # and the forward's o, ht written
        return flops + FWD_FLOP * tokens * HV, nbytes + vo + state
    return flops, nbytes


def decode_cost(H, HV, N, T, verify=False):
    """decode: the pool read and written once; verify: read once, T states written."""
    K, V = K_DIM, V_DIM
    state = N * HV * K * V * 4
    io = N * T * (2 * H * K * 2 + 2 * HV * V * 2 + 2 * HV * 4)
    return DECODE_FLOP * N * T * HV, ((1 + T) * state if verify else 2 * state) + io


def floor_ms(flops, nbytes):
    return max(flops / MATMUL_PEAK, nbytes / COPY_BW) * 1e3


def row_label(r):
    if r["pass"] in ("decode", "verify"):
        return "%s %d/%d N=%d T=%d%s%s" % (r["pass"], r["H"], r["HV"], r["N"], r["T"],
                                           " vk" if r.get("state_layout") == "vk" else "",
                                           " noidx" if r.get("indices") is False else "")
    s = r["seqlens"]
    seq = "+".join(str(x) for x in s) if r.get("layout") == "varlen" else "%dx%d" % (len(s), s[0])
    return "%s%s %d/%d %s" % (r["pass"], "+gates" if r.get("gates") == "fused" else "", r["H"], r["HV"],
                              seq)


def spec_label(pass_, spec):
    return row_label(dict(spec, **{"pass": pass_}))


def new_row(pass_, spec):
    """A row with its shape, cost model and empty timings."""
    r = {"pass": pass_, "H": spec["H"], "HV": spec["HV"], "flashqla_ms": None, "flash_qla_ms": None,
         "fla_ms": None, "errors": {}}
    if pass_ in ("decode", "verify"):
        flops, nbytes = decode_cost(spec["H"], spec["HV"], spec["N"], spec["T"], pass_ == "verify")
        r.update(seqlens=[spec["T"]] * spec["N"], N=spec["N"], T=spec["T"],
                 state_layout=spec.get("state_layout", "kv"), indices=spec.get("indices", True),
                 flop_model="decode 7*K*V per token/value head", anchor_ms=spec["anchor"])
        r["errors"]["flash_qla"] = "FlashQLA has no decode step"
        if pass_ == "verify":
            r["fla_note"] = ("FLA 0.6.0's fused_recurrent returns no intermediate states: its column is "
                             "the same T tokens with the final state only")
            r["bytes_model"] = "pool read once + T intermediate states written + token inputs/outputs"
    else:
        geo = row_geometry(spec)
        flops, nbytes = chunk_cost(pass_, spec["H"], spec["HV"], geo["tokens"], geo["N"])
        if spec.get("gates") == "fused":
            r["gates"] = "fused"
            r["errors"]["flash_qla"] = "FlashQLA has no fused gates"
        r.update(seqlens=list(spec["seqlens"]), layout=spec["layout"], B=geo["B"], N=geo["N"],
                 tokens=geo["tokens"], anchor_ms=row_anchor(pass_, spec),
                 flop_model={"fwd": "fwd 183 kFLOP/token/value head",
                             "bwd": "bwd ESTIMATE 2.5 x 183 kFLOP/token/value head",
                             "train": "fwd + bwd ESTIMATE 3.5 x 183 kFLOP/token/value head"}[pass_])
        if pass_ in ("fwd", "train"):
            r["peak_extra_mib"] = {lib: None for lib in LIBS}
    r.update(flop=flops, bytes=nbytes, floor_ms=floor_ms(flops, nbytes))
    return r


def derive_metrics(r):
    fq, fqla, fl = r.get("flashqla_ms"), r.get("flash_qla_ms"), r.get("fla_ms")
    flop = r.get("flop")
    r["tflops"] = flop / (fq * 1e-3) / 1e12 if (fq and flop) else None
    r["pct_floor"] = 100.0 * r["floor_ms"] / fq if (fq and r.get("floor_ms")) else None
    r["flash_qla_over_flashqla"] = fqla / fq if (fq and fqla) else None
    r["fla_over_flashqla"] = fl / fq if (fq and fl) else None
    pub = (r.get("anchor_ms") or {}).get("flashqla_pub")
    r["flashqla_pub_over_ours"] = pub / fq if (pub and fq) else None
    a = r.get("anchor_ms") or {}
    ours = a.get("fla_ours") or a.get("fla_pub")
    r["fla_vs_anchor"] = fl / ours if (fl and ours) else None


# -------------------------------------------------------------------------- utilities --
def log(*a):
    print(*a, flush=True)


def short_err(e, n=300):
    s = " ".join(("%s: %s" % (type(e).__name__, e)).split())
    return s if len(s) <= n else s[:n] + "..."


def clean_json(obj):
    """Replace NaN/Inf (invalid JSON) by None, recursively."""
    if isinstance(obj, dict):
        return {k: clean_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean_json(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


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


def source_commit():
    """FQ_COMMIT (set by whoever starts the device run: the device copy has no .git), else git."""
    c = os.environ.get("FQ_COMMIT")
    if c:
        return c
    try:
        out = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            dirty = subprocess.run(["git", "-C", HERE, "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return out.stdout.strip() + ("-dirty" if dirty else "")
    except Exception:
        pass
    return None


def module_version(name):
    try:
        import importlib.metadata as md
        return md.version(name)
    except Exception:
        return None


def filter_kwargs(fn, kw):
    """Keep only the keyword arguments fn accepts."""
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


def tensor_bytes(xs):
    """Logical bytes of the tensors in xs (nested tuples/lists/dicts; None ignored)."""
    if xs is None:
        return 0
    if isinstance(xs, dict):
        return sum(tensor_bytes(v) for v in xs.values())
    if isinstance(xs, (list, tuple)):
        return sum(tensor_bytes(v) for v in xs)
    if torch is not None and isinstance(xs, torch.Tensor):
        return xs.numel() * xs.element_size()
    return 0


class Budget:
    """--time-budget: rows that would start after `seconds` (counted from `start`) are skipped;
    0 means no limit. clock is injectable for tests."""

    def __init__(self, seconds, start=None, clock=time.time):
        self.seconds = float(seconds or 0)
        self.clock = clock
        self.start = clock() if start is None else start

    def elapsed(self):
        return self.clock() - self.start

    def left(self):
        return float("inf") if not self.seconds else self.seconds - self.elapsed()

    def out(self):
        return bool(self.seconds) and self.left() <= 0


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


def fused_gate_inputs(t, B, T, HV, gen, device):
    """Raw gate inputs of the fused-gate rows, shaped like Qwen3-Next's: a, b ~ randn (fp32),
    A_log = log(A) with A uniform in [1, 16], dt_bias = softplus^-1(dt), dt uniform in
    [0.001, 0.1] (the model's initialisation)."""
    t.a = torch.randn(B, T, HV, generator=gen, device=device)
    t.b = torch.randn(B, T, HV, generator=gen, device=device)
    A = 1 + 15 * torch.rand(HV, generator=gen, device=device)
    dt = 0.001 + 0.099 * torch.rand(HV, generator=gen, device=device)
    t.A_log = torch.log(A)
    t.dt_bias = dt + torch.log(-torch.expm1(-dt))


def make_chunk_inputs(H, HV, geo, seqlens, gen, device=None, grads=False, gates="anchor", empty=False):
    """One input set. empty=True: uninitialised tensors of the same shapes (for tracing calls
    whose values do not matter, e.g. prebuild_flashqla_cache.py); cu_seqlens are always real."""
    device = device or DEVICE
    B, T, N = geo["B"], geo["T"], geo["N"]
    t = types.SimpleNamespace(B=B, T=T, H=H, HV=HV, N=N, scale=K_DIM ** -0.5)
    bf = torch.bfloat16
    if empty:
        t.q = torch.empty(B, T, H, K_DIM, dtype=bf, device=device)
        t.k = torch.empty(B, T, H, K_DIM, dtype=bf, device=device)
        t.v = torch.empty(B, T, HV, V_DIM, dtype=bf, device=device)
        t.g, t.beta = torch.empty(B, T, HV, device=device), torch.empty(B, T, HV, device=device)
        t.h0 = torch.empty(N, HV, K_DIM, V_DIM, device=device)
    else:
        t.q = l2norm_bf16(torch.randn(B, T, H, K_DIM, generator=gen, device=device))
        t.k = l2norm_bf16(torch.randn(B, T, H, K_DIM, generator=gen, device=device))
        t.v = torch.randn(B, T, HV, V_DIM, generator=gen, device=device).to(bf)
        make_g = strong_gates if gates == "strong" else anchor_gates
        t.g, t.beta = make_g(B, T, HV, gen, device)
        t.h0 = torch.randn(N, HV, K_DIM, V_DIM, generator=gen, device=device)
    t.cu_list = t.cu32 = t.cu64 = None
    if geo["varlen"]:
        cu = [0]
        for s in seqlens:
            cu.append(cu[-1] + s)
        t.cu_list = cu
        t.cu32 = torch.tensor(cu, dtype=torch.int32, device=device)
        t.cu64 = torch.tensor(cu, dtype=torch.int64, device=device)
    t.ci = None  # FLA chunk_indices, filled by the FLA adapter
    t.fused = gates == "fused" and not empty
    if t.fused:
        fused_gate_inputs(t, B, T, HV, gen, device)
    if grads:
        if empty:
            t.do = torch.empty(B, T, HV, V_DIM, dtype=bf, device=device)
            t.dht = torch.empty(N, HV, K_DIM, V_DIM, device=device)
        else:
            t.do = torch.randn(B, T, HV, V_DIM, generator=gen, device=device).to(bf)
            t.dht = torch.randn(N, HV, K_DIM, V_DIM, generator=gen, device=device)
    return t


def share_cu(sets):
    """One cu_seqlens tensor for all rotated sets (their values are equal): FlashQLA keys its
    host-side caches (CP split, chunk offsets) on the tensor object and asserts on a miss during
    CUDA-graph capture, and its cache holds 4 entries."""
    for t in sets[1:]:
        t.cu_list, t.cu32, t.cu64 = sets[0].cu_list, sets[0].cu32, sets[0].cu64


def leaves_of(t):
    """Fresh leaves requiring grad that share t's storage: q, k, v, g, beta, h0."""
    return [x.detach().requires_grad_(True) for x in (t.q, t.k, t.v, t.g, t.beta, t.h0)]


def make_decode_inputs(H, HV, N, T, gen, device=None, layout="kv", verify=False, indices=True):
    device = device or DEVICE
    t = types.SimpleNamespace(B=N, T=T, H=H, HV=HV, N=N, scale=K_DIM ** -0.5)
    t.q = l2norm_bf16(torch.randn(N, T, H, K_DIM, generator=gen, device=device))
    t.k = l2norm_bf16(torch.randn(N, T, H, K_DIM, generator=gen, device=device))
    t.v = torch.randn(N, T, HV, V_DIM, generator=gen, device=device).to(torch.bfloat16)
    t.g, t.beta = anchor_gates(N, T, HV, gen, device)
    t.state0 = torch.randn(N, HV, K_DIM, V_DIM, generator=gen, device=device)
    t.layout = layout
    if layout == "vk":                   # the same states, stored [N, HV, V, K]
        t.state0 = t.state0.transpose(-1, -2).contiguous()
    t.state = t.state0.clone()           # flashqla's pool, updated in place
    # (indices=False: flashqla takes the states as they are, slot n for sequence n)
    t.indices = torch.arange(N, dtype=torch.int32, device=device) if indices else None
    t.inter = torch.empty((N, T) + tuple(t.state0.shape[1:]), device=device) if verify else None
    return t


def chunk_sets(pass_, spec, R, device=None, empty=False):
    """R input sets of a chunk row; the same seeds in every process, so FLA's process sees the
    same inputs."""
    geo = row_geometry(spec)
    gen = None if empty else torch.Generator(device=device or DEVICE).manual_seed(
        1000 + spec["H"] * 7 + spec["HV"] + geo["tokens"] + 100000 * PASSES.index(pass_))
    sets = [make_chunk_inputs(spec["H"], spec["HV"], geo, spec["seqlens"], gen, device=device,
                              grads=(pass_ != "fwd"), gates=spec.get("gates", "anchor"), empty=empty)
            for _ in range(R)]
    share_cu(sets)
    return sets


def decode_sets(spec, R, verify=False):
    gen = torch.Generator(device=DEVICE).manual_seed(2000 + spec["N"] * 3 + spec["T"] + spec["HV"])
    return [make_decode_inputs(spec["H"], spec["HV"], spec["N"], spec["T"], gen,
                               layout=spec.get("state_layout", "kv"), verify=verify,
                               indices=spec.get("indices", True)) for _ in range(R)]


def cur_stream():
    return torch.cuda.current_stream().cuda_stream


# --------------------------------------------------------------------------- flashqla --
class Flashqla:
    """flashqla through its public API (api="public", the default): inference forward
    gdn_chunk under no_grad, backward alone gdn_chunk_bwd(ctx, do, dht) with ctx from
    gdn_chunk_fwd, training step gdn_chunk with inputs requiring grad + torch.autograd.grad,
    decode gdn_recurrent; api="c": forward, backward and decode through flashqla._C with
    preallocated outputs and workspace (the training step is autograd, public either way)."""

    name = "flashqla"

    def __init__(self, api="public"):
        import flashqla
        self.pkg = flashqla
        import importlib
        self.C = getattr(flashqla, "_C", None) or importlib.import_module("flashqla._C")
        self.api = api
        self.version = getattr(flashqla, "__version__", None)
        self.cuda_built = bool(self.C.cuda_built())

    def workspace(self, op, B, T, H, HV, N):
        n = int(self.C.workspace_bytes(op, B, T, H, HV, K_DIM, V_DIM, N, "bfloat16"))
        return torch.empty(n, dtype=torch.uint8, device=DEVICE) if n > 0 else None

    # ---- inference forward: prepare(t) once per set, fwd(t, st) per timed call -> (o, ht)
    def fwd_prepare(self, t):
        if self.api == "public":
            return None
        return types.SimpleNamespace(o=torch.full_like(t.v, float("nan")), ht=torch.full_like(t.h0, float("nan")),
                                     ws=self.workspace("fwd", t.B, t.T, t.H, t.HV, t.N))

    @staticmethod
    def gates(t):
        """(g, beta, options): the fused-gate rows pass the raw a, b and the gate parameters."""
        if not getattr(t, "fused", False):
            return t.g, t.beta, {}
        return t.a, t.b, dict(use_gate_in_kernel=True, A_log=t.A_log, dt_bias=t.dt_bias,
                              use_beta_sigmoid_in_kernel=True)

    def fwd(self, t, st):
        g, beta, gkw = self.gates(t)
        if st is None:
            with torch.no_grad():
                return self.pkg.gdn_chunk(t.q, t.k, t.v, g, beta, scale=t.scale, initial_state=t.h0,
                                          output_final_state=True, cu_seqlens=t.cu32, **gkw)
        self.C.chunk_fwd(t.q, t.k, t.v, g, beta, st.o, scale=t.scale, initial_state=t.h0,
                         final_state=st.ht, cu_seqlens=t.cu32, workspace=st.ws, stream=cur_stream(), **gkw)
        return st.o, st.ht

    def fwd_public(self, t):
        return self.fwd(t, None)

    # ---- backward alone: bwd_prepare(t) runs the forward once for its context
    def bwd_prepare(self, t):
        if self.api == "public":
            _, _, ctx = self.pkg.gdn_chunk_fwd(t.q, t.k, t.v, t.g, t.beta, scale=t.scale, initial_state=t.h0,
                                               output_final_state=True, cu_seqlens=t.cu32)
            return ctx
        nan = float("nan")
        return types.SimpleNamespace(
            dq=torch.full_like(t.q, nan), dk=torch.full_like(t.k, nan), dv=torch.full_like(t.v, nan),
            dg=torch.full_like(t.g, nan), dbeta=torch.full_like(t.beta, nan),
            dh0=torch.full_like(t.h0, nan), ws=self.workspace("bwd", t.B, t.T, t.H, t.HV, t.N))

    def bwd(self, t, st):
        """-> dict dq, dk, dv, dg, dbeta, dh0."""
        if self.api == "public":
            return dict(zip(GRAD_NAMES, self.pkg.gdn_chunk_bwd(st, t.do, t.dht)))
        self.C.chunk_bwd(t.q, t.k, t.v, t.g, t.beta, t.do, st.dq, st.dk, st.dv, st.dg, st.dbeta,
                         scale=t.scale, initial_state=t.h0, dfinal_state=t.dht,
                         dinitial_state=st.dh0, cu_seqlens=t.cu32, workspace=st.ws, stream=cur_stream())
        return {n: getattr(st, n) for n in GRAD_NAMES}

    # ---- training step through autograd: leaves = leaves_of(t)
    def train(self, t, leaves):
        """-> (o, ht, dict of the six gradients)."""
        q, k, v, g, beta, h0 = leaves
        o, ht = self.pkg.gdn_chunk(q, k, v, g, beta, scale=t.scale, initial_state=h0,
                                   output_final_state=True, cu_seqlens=t.cu32)
        grads = torch.autograd.grad([o, ht], leaves, [t.do, t.dht])
        return o, ht, dict(zip(GRAD_NAMES, grads))

    # ---- decode step: state pool t.state updated in place
    def dec_prepare(self, t):
        if self.api == "public":
            return None
        return types.SimpleNamespace(o=torch.full_like(t.v, float("nan")),
                                     ws=self.workspace("recurrent", t.B, t.T, t.H, t.HV, t.N))

    def recurrent(self, t, st):
        """decode (the pool updated) or, with t.inter, verify (intermediate states, the pool
        untouched); the [V, K] pool with t.layout == "vk"."""
        kw = {}
        if getattr(t, "layout", "kv") != "kv":
            kw["state_layout"] = t.layout
        if getattr(t, "inter", None) is not None:
            kw.update(intermediate_states=t.inter, update_state=False)
        if st is None:
            return self.pkg.gdn_recurrent(t.q, t.k, t.v, t.g, t.beta, t.state, state_indices=t.indices,
                                          scale=t.scale, **kw)
        self.C.recurrent(t.q, t.k, t.v, t.g, t.beta, t.state, st.o, scale=t.scale,
                         state_indices=t.indices, workspace=st.ws, stream=cur_stream(), **kw)
        return st.o

    def host_us(self, t, st, n=200):
        """Host time of one eager call (µs; issue 11 goal <= 10 µs): n calls enqueued back to
        back, timed on the host before the final synchronisation (the kernels are shorter than
        the enqueue, so the queue never fills)."""
        self.recurrent(t, st)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            self.recurrent(t, st)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        return (t1 - t0) / n * 1e6


# -------------------------------------------------------------------------- FlashQLA --
class FlashQla:
    """QwenLM's FlashQLA 0.1.3 (package flash_qla, TileLang kernels), its public PyTorch calls
    (flash_qla/ops/gated_delta_rule/chunk/__init__.py):

        chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
            output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None,
            head_first=False, state_v_first=False, auto_cp=True, enable_fwd_cp_cache=True,
            cp_context=None, force_intra_cp=False) -> (o [B,T,HV,V] in q's dtype,
            final_state [N,HV,K,V] fp32 or None)
        chunk_gated_delta_rule_bwd(q, k, v, g, beta, A, do, dht=None, scale=None,
            initial_state=None, cu_seqlens=None, state_v_first=False, auto_cp=True,
            cp_cache=None, cp_context=None) -> (dq, dk, dv, db, dg, dh0)

    q, k [B,T,H,K] and v [B,T,HV,V] bf16/fp16 (K = V = 128 only), g (log space) and beta
    [B,T,HV] (fp32 here), h0 [N,HV,K,V] fp32 (state_v_first=False: K first, like ours),
    cu_seqlens [N+1] with B = 1; its dtype picks the kernels (int32 here, like the int32 that
    FlashQLA synthesises for a B = 1 call without cu_seqlens, so those rows share kernels).
    Defaults kept: automatic intra-card CP (auto_cp=True) and, when inputs require grad, the
    forward's CP cache for the backward (enable_fwd_cp_cache=True)."""

    name = "flash_qla"

    def __init__(self):
        import flash_qla
        import tilelang
        self.pkg = flash_qla
        self.fn = flash_qla.chunk_gated_delta_rule
        self.bwd_fn = flash_qla.chunk_gated_delta_rule_bwd
        self.version = getattr(flash_qla, "__version__", None) or module_version("flash-qla")
        self.tilelang_version = getattr(tilelang, "__version__", None)
        try:
            self.cache_dir = str(tilelang.env.TILELANG_CACHE_DIR)
        except Exception:
            self.cache_dir = os.environ.get("TILELANG_CACHE_DIR")

    def cache_entries(self):
        """Compiled kernels in TileLang's disk cache (<dir>/<version>/<platform>/kernels/<key>)."""
        if not self.cache_dir:
            return set()
        return set(glob.glob(os.path.join(self.cache_dir, "*", "*", "kernels", "*")))

    def fwd(self, t, st=None):
        """Inference forward -> (o, ht)."""
        with torch.no_grad():
            return self.fn(t.q, t.k, t.v, t.g, t.beta, scale=t.scale, initial_state=t.h0,
                           output_final_state=True, cu_seqlens=t.cu32)

    fwd_public = fwd

    def fwd_prepare(self, t):
        return None

    def bwd_prepare(self, t):
        """The saved context of an autograd forward (its grad_fn: saved tensors, cp_context,
        cp_cache, scale), exactly what ChunkGatedDeltaRuleFunction.backward reads, and the
        forward's outputs, kept alive with it: every FlashQLA bwd row raised "saved tensors
        after they have already been freed" at 0837fc4 with the context alone (torch 2.11;
        a toy Function on torch 2.15 keeps its saved tensors without its outputs, so this
        is a probe, to be read at the next GPU run)."""
        leaves = leaves_of(t)
        with torch.enable_grad():
            o, ht = self.fn(*leaves[:5], scale=t.scale, initial_state=leaves[5], output_final_state=True,
                            cu_seqlens=t.cu32)
        return o.grad_fn, o, ht

    def bwd(self, t, st):
        """What ChunkGatedDeltaRuleFunction.backward calls, given the forward's context."""
        ctx = st[0]
        q, k, q_rstd, k_rstd, v, g, beta, A, h0, cu = ctx.saved_tensors
        dq, dk, dv, db, dg, dh0 = self.bwd_fn(
            q=q, k=k, v=v, g=g, beta=beta, A=A, do=t.do, dht=t.dht, scale=ctx.scale, initial_state=h0,
            cu_seqlens=cu, state_v_first=ctx.state_v_first, auto_cp=ctx.autocp, cp_cache=ctx.cp_cache,
            cp_context=ctx.cp_context)
        return {"dq": dq, "dk": dk, "dv": dv, "dg": dg, "dbeta": db, "dh0": dh0}

    def train(self, t, leaves):
        q, k, v, g, beta, h0 = leaves
        o, ht = self.fn(q, k, v, g, beta, scale=t.scale, initial_state=h0, output_final_state=True,
                        cu_seqlens=t.cu32)
        grads = torch.autograd.grad([o, ht], leaves, [t.do, t.dht])
        return o, ht, dict(zip(GRAD_NAMES, grads))


# -------------------------------------------------------------------------------- FLA --
class Fla:
    """FLA's Triton path (only in the FLA process, with FLA_DISABLE_BACKEND_DISPATCH=1 set
    before fla is imported): public forward and training step, internal backward alone given
    the forward's saved intermediates, fused_recurrent decode."""

    name = "fla"
    GUARD = "fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1"

    def __init__(self):
        for k, v in FLA_ENV.items():
            os.environ.setdefault(k, v)
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        self.version = getattr(fla, "__version__", None)
        self.chunk = chunk_gated_delta_rule
        self.fused_recurrent = fused_recurrent_gated_delta_rule
        try:
            import fla.backends as fb
            self.dispatch_disabled = bool(getattr(fb, "_DISPATCH_DISABLED", None))
        except Exception:
            self.dispatch_disabled = None
        self.internal_error = None
        try:
            from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd
            self.fwd_internal, self.bwd_internal = chunk_gated_delta_rule_fwd, chunk_gated_delta_rule_bwd
        except Exception as e:
            self.fwd_internal = self.bwd_internal = None
            self.internal_error = short_err(e)
        try:
            from fla.ops.utils.index import prepare_chunk_indices
            self.prepare_chunk_indices = prepare_chunk_indices
        except Exception:
            self.prepare_chunk_indices = None
        self.guard_module, self.guard_before = None, None
        try:
            import fla.ops.common.chunk_o as chunk_o
            if hasattr(chunk_o, "TRITON_ABOVE_3_7_1"):
                self.guard_module, self.guard_before = chunk_o, bool(chunk_o.TRITON_ABOVE_3_7_1)
        except Exception:
            pass
        self.guard_flipped = False
        self.grad_check_ok = None

    def flip_guard(self):
        if self.guard_module is not None and not self.guard_module.TRITON_ABOVE_3_7_1:
            self.guard_module.TRITON_ABOVE_3_7_1 = True
            self.guard_flipped = True

    def prepare(self, t):
        """chunk_indices computed once outside capture (computing it reads the host)."""
        if t.cu64 is not None and self.prepare_chunk_indices is not None and t.ci is None:
            t.ci = self.prepare_chunk_indices(t.cu64, 64)

    def _kw(self, t):
        kw = dict(scale=t.scale, output_final_state=True)
        if t.cu64 is not None:
            kw.update(cu_seqlens=t.cu64, chunk_indices=t.ci)
        return kw

    def fwd(self, t, st=None):
        g, beta, kw = t.g, t.beta, self._kw(t)
        if getattr(t, "fused", False):   # FLA 0.6.0's fused gates, the same options
            g, beta = t.a, t.b
            kw.update(use_gate_in_kernel=True, A_log=t.A_log, dt_bias=t.dt_bias,
                      use_beta_sigmoid_in_kernel=True)
        with torch.no_grad():
            return self.chunk(t.q, t.k, t.v, g, beta, initial_state=t.h0, **kw)

    fwd_public = fwd

    def fwd_prepare(self, t):
        self.prepare(t)
        return None

    def bwd_prepare(self, t):
        """The forward's saved intermediates: (chunk-local cumulative gate, A)."""
        self.prepare(t)
        if self.fwd_internal is None:
            raise RuntimeError("FLA internals not importable: %s" % self.internal_error)
        self.flip_guard()
        kw = dict(q=t.q, k=t.k, v=t.v, g=t.g, beta=t.beta, scale=t.scale, initial_state=t.h0,
                  output_final_state=True, cu_seqlens=t.cu64, chunk_indices=t.ci)
        with torch.no_grad():
            res = self.fwd_internal(**filter_kwargs(self.fwd_internal, kw))
        g_cum, A = res[0], res[2]       # (g, o, A, final_state, initial_state, g_input)
        if tuple(g_cum.shape) != tuple(t.g.shape) or A.shape[:3] != t.v.shape[:3]:
            raise RuntimeError("unexpected chunk_gated_delta_rule_fwd outputs (FLA version?): %s"
                               % [tuple(x.shape) for x in res if hasattr(x, "shape")])
        return g_cum, A

    def bwd(self, t, st):
        g_cum, A = st
        kw = dict(q=t.q, k=t.k, v=t.v, g=g_cum, beta=t.beta, A=A, scale=t.scale,
                  initial_state=t.h0, do=t.do, dht=t.dht, cu_seqlens=t.cu64, chunk_indices=t.ci)
        with torch.no_grad():
            res = self.bwd_internal(**filter_kwargs(self.bwd_internal, kw))  # dq dk dv db dg dh0 ...
        return dict(zip(("dq", "dk", "dv", "dbeta", "dg", "dh0"), res[:6]))

    def train(self, t, leaves):
        self.flip_guard()
        q, k, v, g, beta, h0 = leaves
        o, ht = self.chunk(q, k, v, g, beta, initial_state=h0, **self._kw(t))
        grads = torch.autograd.grad([o, ht], leaves, [t.do, t.dht])
        return o, ht, dict(zip(GRAD_NAMES, grads))

    def dec_prepare(self, t):
        return None

    def recurrent(self, t, st=None):
        kw = dict(state_v_first=True) if getattr(t, "layout", "kv") == "vk" else {}
        with torch.no_grad():
            return self.fused_recurrent(t.q, t.k, t.v, g=t.g, beta=t.beta, scale=t.scale,
                                        initial_state=t.state0, output_final_state=True, **kw)


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
    by the floor estimate (graph launch latency spread over many microsecond-long calls)."""
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


def peak_extra_mib(call):
    """Peak device memory allocated during one (warm, eager) call above what was allocated
    before it (the inputs) and above the bytes of what it returns (its outputs), in MiB."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    res = call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    held = tensor_bytes(res)
    del res
    return (peak - base - held) / 2 ** 20


# ------------------------------------------------------------------- reference check --
def float64_reference(t):
    """o, ht and the gradients for <o, do> + <ht, dht>, float64 on the CPU (flashqla/reference.py)."""
    names = ("q", "k", "v", "g", "beta", "h0")
    R = REFERENCE
    x = {n: getattr(t, n).detach().float().cpu().numpy() for n in names}
    do, dht = t.do.float().cpu().numpy(), t.dht.float().cpu().numpy()
    o, ht = R.forward(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=t.scale, initial_state=x["h0"])
    grads = R.backward(x["q"], x["k"], x["v"], x["g"], x["beta"], do, dfinal_state=dht, scale=t.scale,
                       initial_state=x["h0"])
    ref = {"o": o, "ht": ht}
    ref.update(zip(GRAD_NAMES, grads))
    return {n: torch.from_numpy(v) for n, v in ref.items()}, "flashqla/reference.py (float64 NumPy)"


def check_inputs(gates, seed=1234):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    s = CHECK_SHAPE
    return make_chunk_inputs(s["H"], s["HV"], row_geometry(s), s["seqlens"], gen, grads=True, gates=gates)


def reference_check(libs):
    """Each library in libs ({name: adapter}) against the float64 reference on small cases
    (H=2, HV=4, T=256), ANCHORS gates and DESIGN §3's strong decay: o, ht and the six gradients.
    flashqla: gdn_chunk_fwd + gdn_chunk_bwd (its "bwd" pass); FlashQLA and FLA: their
    autograd (the "train" pass). Returns a dict of relative errors, first-call times and flags."""
    out = {"shape": "B=1 T=256 H=2 HV=4 K=V=128, bf16 q/k/v, fp32 g/beta/h0, h0 and dht given",
           "tolerances": TOL, "cases": {}, "first_call_s": {}}
    for gates in ("anchor", "strong"):
        t = check_inputs(gates)
        ref, out["reference"] = float64_reference(t)
        case = {}
        for name, lib in libs.items():
            t0 = time.time()
            try:
                if name == "flashqla":
                    o, ht = lib.fwd(t, lib.fwd_prepare(t))
                    got = dict(lib.bwd(t, lib.bwd_prepare(t)))
                    got["o"], got["ht"] = o, ht
                else:
                    o, ht, got = lib.train(t, leaves_of(t))
                    got = dict(got, o=o, ht=ht)
                torch.cuda.synchronize()
                case[name] = {n: (rel_err(got[n], ref[n]) if got.get(n) is not None else float("inf"))
                              for n in TOL}
                case[name + "_ok"] = all(case[name][n] <= TOL[n] for n in TOL)
            except Exception as e:
                case[name] = {"error": short_err(e)}
            out["first_call_s"].setdefault(name, round(time.time() - t0, 2))
        out["cases"][gates] = case
    for name in libs:
        flags = [c.get(name + "_ok") for c in out["cases"].values()]
        out[name + "_ok"] = None if any(f is None for f in flags) else all(flags)
    return out


def merge_reference_checks(a, b):
    """Merge two reference_check dicts (this process's and FLA's)."""
    if not a:
        return b
    if not b:
        return a
    out = dict(a)
    for gates, case in (b.get("cases") or {}).items():
        out.setdefault("cases", {}).setdefault(gates, {}).update(case)
    out.setdefault("first_call_s", {}).update(b.get("first_call_s") or {})
    for k, v in b.items():
        if k.endswith("_ok"):
            out[k] = v
    return out


def print_reference_check(rc):
    if not rc or "cases" not in rc:
        if rc and rc.get("error"):
            log("reference check failed:", rc["error"])
        return
    log("\n== float64 reference check (%s; reference: %s) ==" % (rc["shape"], rc.get("reference")))
    names = list(TOL)
    log("%-8s %-10s " % ("gates", "lib") + " ".join("%9s" % n for n in names) + "  ok")
    log("%-8s %-10s " % ("", "tol") + " ".join("%9.0e" % TOL[n] for n in names))
    for gates, case in rc["cases"].items():
        for lib in LIBS:
            if lib not in case:
                continue
            r = case[lib]
            if "error" in r:
                log("%-8s %-10s ERROR %s" % (gates, lib, r["error"]))
            else:
                log("%-8s %-10s " % (gates, lib) + " ".join(
                    "%9.2e" % r[n] if r.get(n) is not None else "%9s" % "-" for n in names)
                    + "  " + ("yes" if case.get(lib + "_ok") else "NO"))


# ------------------------------------------------------------------------------ rows --
class Runner:
    """Times the rows of one process: flashqla and FlashQLA here (libs), or FLA (its process)."""

    def __init__(self, args, libs, budget):
        self.args = args
        self.libs = libs                    # {name: adapter}, in run order
        self.budget = budget
        self.reps = args.reps if args.reps else (15 if args.quick else 50)
        self.ctx_dead = None

    def note_error(self, e):
        s = short_err(e)
        low = s.lower()
        if any(x in low for x in ("illegal memory access", "unspecified launch failure",
                                  "device-side assert", "illegal instruction", "misaligned address")):
            self.ctx_dead = s
        return s

    def set_compile_timeout(self):
        """FlashQLA: bound each nvcc run by the time left (TileLang reads this variable per
        compile), so that a JIT cannot run the whole device call past its budget."""
        if self.budget.seconds:
            os.environ["TILELANG_COMPILE_TIMEOUT_SECONDS"] = "%d" % max(10, self.budget.left())

    def run_row(self, pass_, spec, warmup_only=False):
        r = new_row(pass_, spec)
        R = 1 if warmup_only else rotation_count(r["bytes"], self.args.rotate)
        rep = graph_repeats(r["floor_ms"], R)
        r["rotate"], r["calls_per_graph"] = R, R * rep
        dec = pass_ in ("decode", "verify")
        sets = decode_sets(spec, R, pass_ == "verify") if dec else chunk_sets(pass_, spec, R)
        firsts = {}
        for name, lib in self.libs.items():
            if dec and not hasattr(lib, "recurrent"):
                continue
            if spec.get("gates") == "fused" and name == "flash_qla":
                continue                          # FlashQLA has no fused gates
            if self.ctx_dead:
                r["errors"][name] = "skipped: CUDA context lost earlier (%s)" % self.ctx_dead
                continue
            try:
                firsts[name] = self.run_lib(r, name, lib, pass_, sets, rep, warmup_only)
            except Exception as e:
                r["errors"][name] = self.note_error(e)
                if self.args.verbose:
                    traceback.print_exc()
            try:
                torch.cuda.empty_cache()
            except Exception:
                pass
        r["check"] = compare_outputs(pass_, firsts)
        derive_metrics(r)
        return r

    def run_lib(self, r, name, lib, pass_, sets, rep, warmup_only):
        """One library on one row: first call (JIT, compile), memory, timing. Returns the first
        call's outputs (for the cross-library check)."""
        is_fqla = name == "flash_qla"
        if is_fqla:
            self.set_compile_timeout()
            before = lib.cache_entries()
        for t in sets:
            if hasattr(lib, "prepare") and pass_ not in ("decode", "verify"):
                lib.prepare(t)                    # FLA: chunk_indices, outside capture
        t0 = time.time()
        if pass_ in ("decode", "verify"):
            states = [lib.dec_prepare(t) for t in sets]
            for t in sets:
                if hasattr(t, "state"):
                    t.state.copy_(t.state0)
            first = lib.recurrent(sets[0], states[0])
            if name == "flashqla":
                first = (first, sets[0].state.clone())
            calls = [(lambda t=t, s=s: lib.recurrent(t, s)) for t, s in zip(sets, states)]
        elif pass_ == "fwd":
            states = [lib.fwd_prepare(t) for t in sets]
            first = lib.fwd(sets[0], states[0])
            calls = [(lambda t=t, s=s: lib.fwd(t, s)) for t, s in zip(sets, states)]
        elif pass_ == "bwd":
            states = [lib.bwd_prepare(t) for t in sets]
            first = lib.bwd(sets[0], states[0])
            calls = [(lambda t=t, s=s: lib.bwd(t, s)) for t, s in zip(sets, states)]
        else:  # train
            leaves = [leaves_of(t) for t in sets]
            first = lib.train(sets[0], leaves[0])
            calls = [(lambda t=t, lv=lv: lib.train(t, lv)) for t, lv in zip(sets, leaves)]
        torch.cuda.synchronize()
        first_s = time.time() - t0
        if is_fqla:
            r["flash_qla_jit_s"] = round(first_s, 2)
            r["flash_qla_new_kernels"] = len(lib.cache_entries() - before)
        else:
            r[name + "_first_call_s"] = round(first_s, 2)
        if name == "fla" and pass_ in ("bwd", "train"):
            r["fla_grad_check_ok"] = lib.grad_check_ok
        if warmup_only:
            return first
        if pass_ in ("fwd", "train"):
            try:
                if pass_ == "fwd":
                    r["peak_extra_mib"][name] = peak_extra_mib(lambda: lib.fwd_public(sets[0]))
                else:
                    r["peak_extra_mib"][name] = peak_extra_mib(lambda: lib.train(sets[0], leaves_of(sets[0])))
            except Exception as e:
                r["errors"][name + "_memory"] = self.note_error(e)
        tm = time_calls(calls * rep, self.reps)
        r[name + "_ms"], r[name + "_ms_min"], r[name + "_timing"] = tm["ms"], tm["ms_min"], tm["method"]
        if name == "flashqla" and pass_ in ("decode", "verify"):
            r["flashqla_host_us"] = lib.host_us(sets[0], states[0])
        return first


def _outputs_of(pass_, res):
    """{name: tensor} of a first call's result."""
    if res is None:
        return {}
    if pass_ in ("decode", "verify"):
        return {"o": res[0], "state": res[1]} if isinstance(res, tuple) and len(res) == 2 else {}
    if pass_ == "fwd":
        return {"o": res[0], "ht": res[1]}
    if pass_ == "bwd":
        return dict(res)
    o, ht, grads = res
    return dict(grads, o=o, ht=ht)


def compare_outputs(pass_, firsts):
    """Relative differences of flashqla's outputs from FlashQLA's on the row's first input set."""
    if "flashqla" not in firsts or "flash_qla" not in firsts:
        return {}
    a, b = _outputs_of(pass_, firsts["flashqla"]), _outputs_of(pass_, firsts["flash_qla"])
    out = {}
    for n in a:
        if a[n] is not None and b.get(n) is not None:
            try:
                out[n + "_rel_vs_flash_qla"] = rel_err(a[n], b[n])
            except Exception as e:
                out[n + "_rel_vs_flash_qla"] = None
                out["error"] = short_err(e)
    return out


def check_summary(r):
    c = r.get("check") or {}
    vals = [(k.split("_rel_")[0], v) for k, v in c.items() if "_rel_vs_" in k]
    if not vals:
        return "-"
    worst_k, worst = max(vals, key=lambda kv: kv[1] if kv[1] is not None else float("inf"))
    limit = 2e-2 if r["pass"] in ("fwd", "decode", "verify") else 4e-2
    flag = "ok" if (worst is not None and worst <= limit) else "MISMATCH"
    return "%s max %s %.1e" % (flag, worst_k, worst if worst is not None else float("nan"))


# ---------------------------------------------------------------------------- output --
def fmt(x, f="%.3f", none="-"):
    return none if x is None else f % x


def graph_shape(r):
    R, n = r.get("rotate"), r.get("calls_per_graph")
    return "%dx%d" % (R, n // R) if (R and n) else ("%s" % R if R else "-")


def ordered(rows):
    return sorted(rows, key=lambda r: PASSES.index(r["pass"]) if r.get("pass") in PASSES else 9)


def jit_table(rows):
    """FlashQLA's first-call (JIT) times, apart from the timings."""
    lines = ["", "=== first calls: FlashQLA JIT (compile included) / flashqla / FLA (Triton compile+autotune), s ==="]
    tot, kern = 0.0, 0
    for r in rows:
        if r.get("pass") in ("decode", "verify"):
            continue
        j, n = r.get("flash_qla_jit_s"), r.get("flash_qla_new_kernels")
        tot += j or 0.0
        kern += n or 0
        lines.append("%-26s FlashQLA %7s s (%s new kernels)  flashqla %6s s  FLA %6s s" % (
            row_label(r), fmt(j, "%.1f"), fmt(n, "%d"), fmt(r.get("flashqla_first_call_s"), "%.2f"),
            fmt(r.get("fla_first_call_s"), "%.1f")))
    lines.append("FlashQLA first calls in total: %.1f s, %d kernels compiled" % (tot, kern))
    return "\n".join(lines)


def detail_table(rows):
    lines = ["", "%-26s %9s %8s %6s %8s  %s" % ("row", "fq ms", "TFLOP/s", "%floor", "sets x n",
                                                 "check vs FlashQLA / errors")]
    for r in ordered(rows):
        err = "; ".join("%s: %s" % kv for kv in (r.get("errors") or {}).items()
                        if not (r.get("pass") in ("decode", "verify") and kv[0] == "flash_qla"))
        lines.append("%-26s %9s %8s %6s %8s  %s%s" % (
            row_label(r), fmt(r.get("flashqla_ms"), "%.4f"), fmt(r.get("tflops"), "%.1f"),
            fmt(r.get("pct_floor"), "%.0f%%"), graph_shape(r), check_summary(r),
            ("  [" + err[:240] + "]") if err else ""))
    return "\n".join(lines)


def final_table(rows):
    """The table printed LAST: per row the three times, the two ratios, peak extra MiB."""
    lines = ["", "=== flashqla vs FlashQLA 0.1.3 vs FLA 0.6.0 (ms; ratios > 1: flashqla faster; "
                 "floor of issues 7/8: FlashQLA/fq >= %.2f) ===" % FLOOR_RATIO,
             "%-26s %9s %9s %9s %8s %7s   %s" % ("row", "flashqla", "FlashQLA", "FLA", "FQLA/fq", "FLA/fq",
                                              "peak extra MiB fq / FQLA / FLA")]
    for r in ordered(rows):
        pk = r.get("peak_extra_mib")
        mem = ("%s / %s / %s" % tuple(fmt((pk or {}).get(lib), "%.0f") for lib in LIBS)) if pk else ""
        ratio = r.get("flash_qla_over_flashqla")
        flag = " <" if (ratio is not None and ratio < FLOOR_RATIO) else "  "
        lines.append("%-26s %9s %9s %9s %8s%s%7s   %s" % (
            row_label(r), fmt(r.get("flashqla_ms"), "%.4f"), fmt(r.get("flash_qla_ms"), "%.4f"),
            fmt(r.get("fla_ms"), "%.4f"), fmt(ratio, "%.2f"), flag, fmt(r.get("fla_over_flashqla"), "%.2f"), mem))
    for p in PASSES:
        ps = [r for r in rows if r.get("pass") == p]
        if not ps:
            continue
        q = [r["flash_qla_over_flashqla"] for r in ps if r.get("flash_qla_over_flashqla") is not None]
        f = [r["fla_over_flashqla"] for r in ps if r.get("fla_over_flashqla") is not None]
        skipped = sum(1 for r in ps if (r.get("errors") or {}).get("skipped"))
        lines.append("%-6s rows %2d (skipped %d): FlashQLA/fq measured %2d, min %s, below %.2f: %d | "
                     "FLA/fq measured %2d, min %s" % (
                         p, len(ps), skipped, len(q), fmt(min(q) if q else None, "%.2f"), FLOOR_RATIO,
                         sum(1 for x in q if x < FLOOR_RATIO), len(f), fmt(min(f) if f else None, "%.2f")))
    return "\n".join(lines)


def result_paths(out_dir, gpu_name, date, dry):
    slug = "dryrun" if dry else ("h200" if "H200" in (gpu_name or "") else
                                 "".join(c if c.isalnum() else "_" for c in (gpu_name or "gpu").lower()).strip("_"))
    base = os.path.join(out_dir, "%s_%s" % (slug, date))
    return base + ".json", base + ".png"


def finish(results, json_path, png_path, table_file, write=True, plot=True):
    """Write the JSON, plot, copy to $OUT, print the tables; the final table LAST."""
    for r in results.get("rows", []):
        if "floor_ms" in r:
            derive_metrics(r)
    if write:
        write_json_atomic(json_path, results)
        log("\nwrote", json_path)
    if plot:
        try:
            sys.path.insert(0, HERE)
            import plot as plot_mod
            plot_mod.plot_results(json_path, png_path)
            log("wrote", png_path)
        except Exception as e:
            log("plot failed:", short_err(e))
    out = os.environ.get("OUT")
    if out and write:
        try:
            os.makedirs(out, exist_ok=True)
            for p in (json_path, png_path):
                if os.path.exists(p):
                    shutil.copy(p, out)
            log("copied results to", out)
        except Exception as e:
            log("copy to $OUT failed:", short_err(e))
    rows = results.get("rows", [])
    print_reference_check(results.get("reference_check"))
    log(detail_table(rows))
    log(jit_table(rows))
    table = final_table(rows)
    if table_file:
        try:
            with open(table_file, "w") as f:
                f.write(table + "\n")
        except Exception as e:
            log("table file:", short_err(e))
    log(table)


# ---------------------------------------------------------------------- FLA process --
def run_fla_process(args, plan, budget_s):
    """Time FLA on the planned rows in a child process with FLA_DISABLE_BACKEND_DISPATCH=1
    (and FLA_FLASH_QLA=0, FLA_TILELANG=0) in its environment from the start. The child stops
    starting rows after budget_s and is killed 20 s later. Returns the child's results dict
    ({"rows": [...], ...}; partial if it ran out of time)."""
    # FLA's cheap rows first: its backward rows cost minutes of Triton compilation and
    # autotuning, and a budget spent on them left the decode and verify rows unmeasured
    # (bwd and train stay adjacent per shape: they share FLA's kernels)
    first = {"fwd": 0, "decode": 1, "verify": 2}
    plan = sorted(plan, key=lambda ps: first.get(ps[0], 3))
    work = tempfile.mkdtemp(prefix="bench_gpu_fla_")
    plan_file, json_path = os.path.join(work, "plan.json"), os.path.join(work, "fla.json")
    with open(plan_file, "w") as f:
        json.dump({"plan": [[p, spec_label(p, s)] for p, s in plan]}, f)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "fla", "--plan-file", plan_file,
           "--worker-out", json_path, "--time-budget", "%.0f" % max(1, budget_s), "--rotate", str(args.rotate)]
    if args.reps:
        cmd += ["--reps", str(args.reps)]
    if args.quick:
        cmd.append("--quick")
    if args.no_check:
        cmd.append("--no-check")
    if args.dry_run:
        cmd.append("--dry-run")
    if args.verbose:
        cmd.append("--verbose")
    env = dict(os.environ, **FLA_ENV)
    log("\n== FLA in its own process (FLA_DISABLE_BACKEND_DISPATCH=1), budget %.0f s ==" % budget_s)
    try:
        proc = subprocess.run(cmd, env=env, timeout=budget_s + 20)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = "killed at %.0f s" % (budget_s + 20)
    try:
        with open(json_path) as f:
            res = json.load(f)
    except Exception as e:
        res = {"rows": [], "error": "no results from the FLA process (rc %s): %s" % (rc, short_err(e))}
    res["returncode"] = rc
    shutil.rmtree(work, ignore_errors=True)
    return res


def merge_fla(results, fla_res):
    """Copy the FLA process's per-row numbers into results' rows (matched by row label)."""
    by_label = {r["label"]: r for r in fla_res.get("rows", []) if "label" in r}
    for r in results["rows"]:
        f = by_label.get(row_label(r))
        if f is None:
            if "fla" not in r["errors"]:
                r["errors"]["fla"] = fla_res.get("error") or "not measured (FLA process ran out of time or failed)"
            continue
        for k, v in f.items():
            if k.startswith("fla_"):           # fla_ms, fla_ms_min, fla_timing, fla_first_call_s, ...
                r[k] = v
        if r.get("peak_extra_mib") is not None and (f.get("peak_extra_mib") or {}).get("fla") is not None:
            r["peak_extra_mib"]["fla"] = f["peak_extra_mib"]["fla"]
        for k in ("fla", "fla_memory"):
            if (f.get("errors") or {}).get(k):
                r["errors"][k] = f["errors"][k]
        derive_metrics(r)
    results["fla_process"] = {k: fla_res.get(k) for k in ("returncode", "error", "dispatch_disabled",
                                                          "env", "guard", "versions")}
    results["versions"]["fla"] = (fla_res.get("versions") or {}).get("fla") or results["versions"].get("fla")
    results["reference_check"] = merge_reference_checks(results.get("reference_check"),
                                                        fla_res.get("reference_check"))


def worker_main(args):
    """The FLA process: FLA_DISABLE_BACKEND_DISPATCH=1 set before fla is imported."""
    for k, v in FLA_ENV.items():
        os.environ[k] = v
    with open(args.plan_file) as f:
        labels = [tuple(x) for x in json.load(f)["plan"]]
    specs = {spec_label(p, s): (p, s) for p, s in plan_rows("all")}
    plan = [specs[lab] for _, lab in labels if lab in specs]
    budget = Budget(args.time_budget)
    res = {"env": {k: os.environ.get(k) for k in FLA_ENV}, "rows": []}
    if args.dry_run:
        return dry_worker(args, plan, res)
    try:
        fla = Fla()
    except Exception as e:
        res["error"] = "FLA not importable: %s" % short_err(e)
        write_json_atomic(args.worker_out, res)
        log("[fla]", res["error"])
        return 1
    res["dispatch_disabled"] = fla.dispatch_disabled
    res["versions"] = {"fla": fla.version}
    res["guard"] = {"name": Fla.GUARD, "before": fla.guard_before}
    log("[fla] FLA %s, dispatch disabled: %s, guard %s = %s before flipping" % (
        fla.version, fla.dispatch_disabled, Fla.GUARD, fla.guard_before))
    torch.manual_seed(0)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        if not args.no_check and not args.fla_warmup_only:
            fla.flip_guard()
            try:
                rc = reference_check({"fla": fla})
                fla.grad_check_ok = rc.get("fla_ok")
                res["reference_check"] = rc
            except Exception as e:
                res["reference_check"] = {"error": short_err(e)}
            write_json_atomic(args.worker_out, res)
        runner = Runner(args, {"fla": fla}, budget)
        for pass_, spec in plan:
            lab = spec_label(pass_, spec)
            if budget.out():
                log("[fla] %-26s skipped (time budget)" % lab)
                res["rows"].append({"label": lab, "errors": {"fla": "skipped (time budget of FLA's process)"}})
                continue
            t0 = time.time()
            try:
                r = runner.run_row(pass_, spec, warmup_only=args.fla_warmup_only)
            except Exception as e:
                r = new_row(pass_, spec)
                r["errors"]["fla"] = runner.note_error(e)
            r["label"] = lab
            r["fla_wall_s"] = round(time.time() - t0, 1)
            res["rows"].append(r)
            write_json_atomic(args.worker_out, res)
            pk = (r.get("peak_extra_mib") or {}).get("fla")
            log("[fla] %-26s %s ms  first call %s s  peak extra %s MiB  (%.1f s)%s" % (
                lab, fmt(r.get("fla_ms"), "%.4f"), fmt(r.get("fla_first_call_s"), "%.1f"), fmt(pk, "%.0f"),
                r["fla_wall_s"], ("  errors: %s" % r["errors"]) if r.get("errors") and
                any(k != "flash_qla" for k in r["errors"]) else ""))
            try:
                torch.cuda.empty_cache()
            except Exception:
                pass
    return 0


def dry_worker(args, plan, res):
    """Fake FLA rows (anchor times noise), through the same protocol."""
    rng = random.Random(11)
    res.update(dispatch_disabled=os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") == "1",
               versions={"fla": "dry-run"}, guard={"name": Fla.GUARD, "before": False})
    res["reference_check"] = {"shape": "dry run", "tolerances": TOL, "first_call_s": {"fla": 0.0}, "cases": {
        g: {"fla": {n: rng.uniform(1e-3, 6e-3) for n in TOL}, "fla_ok": True} for g in ("anchor", "strong")},
        "fla_ok": True}
    for pass_, spec in plan:
        r = new_row(pass_, spec)
        r["label"] = spec_label(pass_, spec)
        a = r.get("anchor_ms") or {}
        base = a.get("fla_ours") or a.get("fla_pub") or (r["floor_ms"] * 3.5)
        r["fla_ms"] = base * rng.uniform(0.97, 1.03)
        r["fla_first_call_s"] = round(rng.uniform(0.5, 30), 1)
        if r.get("peak_extra_mib") is not None:
            r["peak_extra_mib"]["fla"] = rng.uniform(100, 3000)
        res["rows"].append(r)
    write_json_atomic(args.worker_out, res)
    return 0


# --------------------------------------------------------------------------- dry run --
def dry_run(args):
    """Fake timings through the same JSON / table / plot / FLA-process code (no GPU)."""
    rng = random.Random(7)
    budget = Budget(args.time_budget)
    date = datetime.date.today().isoformat()
    plan = plan_rows(args.rows, args.max_rows)
    results = {"gpu": "DRY RUN (fake numbers)", "driver": None, "date": date, "commit": source_commit(),
               "versions": {"flashqla": None, "torch": getattr(torch, "__version__", None), "triton": None,
                            "fla": None, "flash_qla": "0.1.3 (fake)", "tilelang": "0.1.15 (fake)",
                            "cuda": None, "driver": None, "python": platform.python_version()},
               "dry_run": True, "time_budget_s": args.time_budget, "rows": []}
    os.makedirs(args.out, exist_ok=True)
    json_path, png_path = result_paths(args.out, results["gpu"], date, True)
    for i, (pass_, spec) in enumerate(plan):
        r = new_row(pass_, spec)
        if args.dry_skip_after and i >= args.dry_skip_after:      # exercises the time-budget path
            r["errors"]["skipped"] = "time budget"
            results["rows"].append(r)
            continue
        a = r.get("anchor_ms") or {}
        fq = a.get("sbs_flashqla") or a.get("fla_ours") or a.get("fla_pub") or r["floor_ms"] * 4
        r.update(flashqla_ms=fq * rng.uniform(0.3, 1.1), rotate=1, calls_per_graph=1, fake=True,
                 flashqla_first_call_s=round(rng.uniform(0.0, 0.05), 3))
        if pass_ not in ("decode", "verify") and not spec.get("gates"):
            fqla = a.get("sbs_flash_qla") or a.get("flashqla_pub") or fq * 0.5
            r.update(flash_qla_ms=fqla * rng.uniform(0.95, 1.05), flash_qla_jit_s=round(rng.uniform(0, 40), 1),
                     flash_qla_new_kernels=rng.randint(0, 6),
                     check={"o_rel_vs_flash_qla": rng.uniform(1e-3, 6e-3)})
            if r.get("peak_extra_mib") is not None:
                r["peak_extra_mib"].update(flashqla=rng.uniform(100, 4000), flash_qla=rng.uniform(100, 2000))
        if rng.random() < 0.1:          # exercise the null path
            r["flashqla_ms"] = None
            r["errors"]["flashqla"] = "RuntimeError: fake failure (dry run)"
        derive_metrics(r)
        results["rows"].append(r)
        write_json_atomic(json_path, results)
    results["reference_check"] = {"shape": "dry run", "tolerances": TOL, "reference": "none (dry run)",
                                  "first_call_s": {}, "flashqla_ok": True, "flash_qla_ok": True, "cases": {
        g: dict({lib: {n: rng.uniform(1e-3, 6e-3) for n in TOL} for lib in ("flashqla", "flash_qla")},
                flashqla_ok=True, flash_qla_ok=True) for g in ("anchor", "strong")}}
    if not args.no_fla:
        fla_res = run_fla_process(args, plan, max(30.0, budget.left() if budget.seconds else 600.0))
        merge_fla(results, fla_res)
    finish(results, json_path, png_path, args.table_file)
    return 0


# ------------------------------------------------------------------------------ main --
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="all",
                   help="passes to run: all, or a comma-separated subset of fwd, bwd, train, decode")
    p.add_argument("--quick", action="store_true", help="15 replays per timing instead of 50")
    p.add_argument("--reps", type=int, default=0, help="replays per timing (overrides --quick)")
    p.add_argument("--out", default=os.path.join(HERE, "results"), help="directory for JSON + PNG")
    p.add_argument("--dry-run", action="store_true", help="fake timings; tests JSON/table/plot/FLA process here")
    p.add_argument("--dry-skip-after", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--rotate", default="auto", help="input sets per timed graph: auto or an integer")
    p.add_argument("--time-budget", type=float, default=0.0,
                   help="seconds; rows that would start later are skipped, FLA's process gets what is "
                        "left (0: no limit)")
    p.add_argument("--fla-reserve", type=float, default=15.0,
                   help="seconds kept for the final tables after FLA's process")
    p.add_argument("--no-fla", action="store_true", help="no FLA process")
    p.add_argument("--no-flash-qla", action="store_true", help="do not import or time FlashQLA")
    p.add_argument("--api", choices=("public", "c"), default="public",
                   help="flashqla through gdn_chunk/gdn_chunk_bwd/gdn_recurrent (public) or through "
                        "flashqla._C with preallocated outputs and workspace (c)")
    p.add_argument("--no-check", action="store_true", help="skip the float64 reference check")
    p.add_argument("--fla-warmup-only", action="store_true",
                   help="FLA only (this process, dispatch disabled): each FLA call once (Triton compile "
                        "+ autotune into the on-disk cache), no timing")
    p.add_argument("--table-file", default=None, help="also write the final table to this file")
    p.add_argument("--path-file", default=None, help="write the results JSON's path to this file first")
    p.add_argument("--from-json", default=None, metavar="PATH",
                   help="no timing: re-plot and re-print the tables of an existing results JSON")
    p.add_argument("--max-rows", type=int, default=0, help="at most this many rows per pass (testing)")
    p.add_argument("--verbose", action="store_true", help="print tracebacks")
    p.add_argument("--worker", choices=("fla",), default=None, help=argparse.SUPPRESS)
    p.add_argument("--plan-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        plan_rows(args.rows)
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            results = json.load(f)
        finish(results, args.from_json, os.path.splitext(args.from_json)[0] + ".png", args.table_file, write=False)
        return 0
    if args.fla_warmup_only:          # FLA's compile + autotune, this process being FLA's
        for k, v in FLA_ENV.items():
            os.environ[k] = v
        plan = plan_rows(args.rows, args.max_rows)
        args.plan_file = tempfile.mktemp(suffix=".json")
        with open(args.plan_file, "w") as f:
            json.dump({"plan": [[p, spec_label(p, s)] for p, s in plan]}, f)
        args.worker_out = args.worker_out or tempfile.mktemp(suffix=".json")
        args.no_check = True
    if args.worker == "fla" or args.fla_warmup_only:
        if args.dry_run:
            return worker_main(args)
        if torch is None or not torch.cuda.is_available():
            log("[fla] no CUDA device visible to torch")
            return 2
        return worker_main(args)
    if args.dry_run:
        return dry_run(args)
    if torch is None or not torch.cuda.is_available():
        log("bench_gpu: no CUDA device visible to torch; nothing to time (use --dry-run to test plumbing)")
        return 2
    torch.manual_seed(0)
    stream = torch.cuda.Stream()       # never the legacy default stream (DLPack stream 0 is invalid)
    with torch.cuda.stream(stream):
        return run(args)


def setup_libs(args):
    """{name: adapter} for this process (flashqla, FlashQLA) and {name: error}."""
    libs, errors = {}, {}
    try:   # FlashQLA first in each row: its numbers survive if flashqla later breaks the context
        if args.no_flash_qla:
            raise RuntimeError("not loaded (--no-flash-qla)")
        t0 = time.time()
        libs["flash_qla"] = FlashQla()
        log("FlashQLA %s (TileLang %s) imported in %.1f s; TILELANG_CACHE_DIR %s holds %d kernels" % (
            libs["flash_qla"].version, libs["flash_qla"].tilelang_version, time.time() - t0,
            libs["flash_qla"].cache_dir, len(libs["flash_qla"].cache_entries())))
    except Exception as e:
        errors["flash_qla"] = short_err(e)
        log("FlashQLA not usable:", errors["flash_qla"])
    try:
        fq = Flashqla(args.api)
        if not fq.cuda_built:
            raise RuntimeError("flashqla was built without CUDA (_C.cuda_built() is False)")
        libs["flashqla"] = fq
    except Exception as e:
        errors["flashqla"] = short_err(e)
        log("flashqla not usable:", errors["flashqla"])
    return libs, errors


def run(args):
    budget = Budget(args.time_budget)
    date = datetime.date.today().isoformat()
    gpu = torch.cuda.get_device_name()
    reps = args.reps if args.reps else (15 if args.quick else 50)
    log("bench_gpu: %s, torch %s, CUDA %s, replays %d, time budget %s" % (
        gpu, torch.__version__, torch.version.cuda, reps, ("%.0f s" % args.time_budget) if args.time_budget else "none"))
    libs, lib_errors = setup_libs(args)
    try:
        import triton
        triton_v = triton.__version__
    except Exception:
        triton_v = None
    fq, fqla = libs.get("flashqla"), libs.get("flash_qla")
    results = {"gpu": gpu, "driver": nvidia_driver(), "date": date, "commit": source_commit(),
               "versions": {"flashqla": fq.version if fq else module_version("flashqla"),
                            "torch": torch.__version__, "triton": triton_v, "fla": module_version("fla-core"),
                            "flash_qla": fqla.version if fqla else module_version("flash-qla"),
                            "tilelang": fqla.tilelang_version if fqla else module_version("tilelang"),
                            "cuda": torch.version.cuda, "driver": None, "python": platform.python_version()},
               "method": ("CUDA-graph replays between CUDA events, median of %d after warm-up, per call; "
                          "R input sets per graph when data < 4x L2 (row key 'rotate'), each repeated so "
                          "a replay holds >= 0.1 ms of floor-estimated work (key 'calls_per_graph'); "
                          "peak_extra_mib: one warm eager call, max_memory_allocated above the inputs and "
                          "the call's outputs" % reps),
               "calls": {"flashqla": ("gdn_chunk (no_grad) | gdn_chunk_fwd + gdn_chunk_bwd | gdn_chunk + "
                                      "autograd.grad | gdn_recurrent" if args.api == "public" else
                                      "flashqla._C chunk_fwd | chunk_bwd | (train: gdn_chunk + autograd.grad) | recurrent"),
                         "flash_qla": ("chunk_gated_delta_rule (no_grad) | chunk_gated_delta_rule_bwd given the "
                                       "autograd forward's saved tensors, cp_context, cp_cache | "
                                       "chunk_gated_delta_rule + autograd.grad"),
                         "fla": ("chunk_gated_delta_rule (no_grad) | chunk.chunk_gated_delta_rule_bwd given "
                                 "chunk_gated_delta_rule_fwd's (g_cumsum, A), guard %s flipped | "
                                 "chunk_gated_delta_rule + autograd.grad | fused_recurrent_gated_delta_rule; "
                                 "own process, FLA_DISABLE_BACKEND_DISPATCH=1" % Fla.GUARD)},
               "tilelang_cache_dir": fqla.cache_dir if fqla else os.environ.get("TILELANG_CACHE_DIR"),
               "flashqla_api": args.api, "lib_errors": lib_errors, "time_budget_s": args.time_budget,
               "rows": []}
    results["versions"]["driver"] = results["driver"]
    os.makedirs(args.out, exist_ok=True)
    json_path, png_path = result_paths(args.out, gpu, date, False)
    if args.path_file:                      # tells gpu_check.sh where a partial JSON is
        try:
            with open(args.path_file, "w") as f:
                f.write(json_path + "\n")
        except Exception as e:
            log("path file:", short_err(e))
    plan = plan_rows(args.rows, args.max_rows)
    runner = Runner(args, libs, budget)

    if not args.no_check and libs:
        t0 = time.time()
        try:
            runner.set_compile_timeout()
            rc = reference_check(libs)
            results["reference_check"] = rc
            print_reference_check(rc)
            log("reference check took %.1f s (first calls: %s)" % (time.time() - t0, rc.get("first_call_s")))
        except Exception as e:
            results["reference_check"] = {"error": runner.note_error(e)}
            log("reference check failed:", short_err(e))
            if args.verbose:
                traceback.print_exc()
        write_json_atomic(json_path, results)

    for pass_, spec in plan:
        label = spec_label(pass_, spec)
        if budget.out():
            r = new_row(pass_, spec)
            r["errors"]["skipped"] = "time budget"
            results["rows"].append(r)
            log("%-26s skipped (time budget %.0f s)" % (label, args.time_budget))
            continue
        t0 = time.time()
        try:
            r = runner.run_row(pass_, spec)
        except Exception as e:   # input construction, OOM, ...
            r = new_row(pass_, spec)
            r["errors"]["row"] = runner.note_error(e)
            if args.verbose:
                traceback.print_exc()
        r["wall_s"] = round(time.time() - t0, 1)
        for name, err in lib_errors.items():           # why a library has no number here
            r["errors"].setdefault(name, err)
        results["rows"].append(r)
        write_json_atomic(json_path, results)          # partial results survive a kill
        pk = r.get("peak_extra_mib") or {}
        errs = {k: v for k, v in r["errors"].items()
                if not (pass_ in ("decode", "verify") and k == "flash_qla")}
        log("%-26s fq %s ms  FlashQLA %s ms (x%s)  JIT %s s/%s kernels  peak MiB fq %s FQLA %s  [%s]  (%.1f s)%s" % (
            label, fmt(r.get("flashqla_ms"), "%.4f"), fmt(r.get("flash_qla_ms"), "%.4f"),
            fmt(r.get("flash_qla_over_flashqla"), "%.2f"), fmt(r.get("flash_qla_jit_s"), "%.1f"),
            fmt(r.get("flash_qla_new_kernels"), "%d"), fmt(pk.get("flashqla"), "%.0f"),
            fmt(pk.get("flash_qla"), "%.0f"), check_summary(r), r["wall_s"],
            ("  errors: %s" % errs) if errs else ""))
    try:
        torch.cuda.empty_cache()
    except Exception:
        pass
    if not args.no_fla:
        left = budget.left() - args.fla_reserve if budget.seconds else 3600.0
        if left < 20:
            for r in results["rows"]:
                r["errors"].setdefault("fla", "not measured: no time left for FLA's process")
            results["fla_process"] = {"error": "skipped: %.0f s left" % (left + args.fla_reserve)}
        else:
            merge_fla(results, run_fla_process(args, plan, left))
    finish(results, json_path, png_path, args.table_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
