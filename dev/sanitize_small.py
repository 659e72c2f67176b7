#!/usr/bin/env python3
"""Tiny flashqla CUDA run for compute-sanitizer (memcheck, racecheck): forward, backward and
recurrent step, K = V = 64 and 128, T = 130, 2 value heads (and a recurrent step of 24
sequences x 32 value heads, where each block of the kernel takes several items), checked
against the float64 token-by-token reference (flashqla/reference.py) with the project's
tolerances (bf16 row).

    compute-sanitizer --tool memcheck  --error-exitcode 86 python3 dev/sanitize_small.py
    compute-sanitizer --tool racecheck --error-exitcode 86 python3 dev/sanitize_small.py --quick

Every input is made on the CPU and copied (cudaMemcpy, no kernels), outputs are NaN-poisoned
on the CPU and copied, each tensor is its own cudaMalloc (PYTORCH_NO_CUDA_MEMORY_CACHING=1),
results are copied back and checked on the CPU: the only kernels the sanitizer sees are
flashqla's. Runs on a non-default torch stream, passed to flashqla._C.
Prints one line per check and "sanitize_small: ALL OK" or "sanitize_small: FAILED (n)";
exit status 0 / 1 (the sanitizer's own --error-exitcode tells memory errors apart).
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

# One cudaMalloc per tensor: with PyTorch's caching allocator, tensors share large segments
# and memcheck cannot see an access past one tensor that stays inside its segment.
os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from flashqla import reference as R  # noqa: E402  (the float64 reference and tolerance table)

TOL = {n: R.tolerance("bfloat16", n) for n in ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0")}

failures = []


def rel(out, ref):
    a, b = out.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(a).all():
        return float("inf")
    den = torch.linalg.vector_norm(b).item()
    return torch.linalg.vector_norm(a - b).item() / (den if den > 0 else 1.0)


def report(what, errs, tol):
    bad = [n for n, e in errs.items() if not (e <= tol[n])]
    line = " ".join("%s %.1e" % (n, e) for n, e in errs.items())
    print("sanitize_small: %-44s %s  %s" % (what, line, "OK" if not bad else "FAIL " + ",".join(bad)),
          flush=True)
    if bad:
        failures.append(what)


def cpu_inputs(gen, B, T, H, HV, K, N, l2norm_inside):
    """bf16 q, k, v; DESIGN §3 gates (A_h from 0 to 16); fp32 h0, do, dht. CPU tensors."""
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    if not l2norm_inside:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    A = torch.linspace(0, 16, HV)
    return dict(
        q=q.to(torch.bfloat16), k=k.to(torch.bfloat16),
        v=torch.randn(B, T, HV, K, generator=gen).to(torch.bfloat16),
        g=(-A * F.softplus(0.5 * torch.randn(B, T, HV, generator=gen) + 1)).contiguous(),
        beta=torch.sigmoid(torch.randn(B, T, HV, generator=gen)),
        h0=torch.randn(N, HV, K, K, generator=gen),
        do=torch.randn(B, T, HV, K, generator=gen).to(torch.bfloat16),
        dht=torch.randn(N, HV, K, K, generator=gen))


def reference(x, scale, cu, l2norm_inside):
    """o, ht and the gradients of <o, do> + <ht, dht> from flashqla/reference.py (float64)."""
    a = {n: x[n].double().numpy() for n in x}
    cu = None if cu is None else np.asarray(cu, dtype=np.int64)
    o, ht = R.forward(a["q"], a["k"], a["v"], a["g"], a["beta"], scale=scale, initial_state=a["h0"],
                      cu_seqlens=cu, use_qk_l2norm=l2norm_inside)
    grads = R.backward(a["q"], a["k"], a["v"], a["g"], a["beta"], a["do"], dfinal_state=a["dht"],
                       scale=scale, initial_state=a["h0"], cu_seqlens=cu, use_qk_l2norm=l2norm_inside)
    ref = {"o": o, "ht": ht}
    ref.update(zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads))
    return {n: torch.from_numpy(v) for n, v in ref.items()}


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def nan_like(t, dev):
    return torch.full(t.shape, float("nan"), dtype=t.dtype).to(dev)


def workspace(C, op, B, T, H, HV, K, N, dev):
    n = int(C.workspace_bytes(op, B, T, H, HV, K, K, N, "bfloat16"))
    return torch.empty(n, dtype=torch.uint8, device=dev) if n > 0 else None


def chunk_case(C, K, H, HV, seqlens, varlen, l2norm_inside, stream, dev):
    gen = torch.Generator().manual_seed(K * 100 + H * 10 + HV + len(seqlens))
    if varlen:
        B, T, N = 1, sum(seqlens), len(seqlens)
        cu = [0]
        for s in seqlens:
            cu.append(cu[-1] + s)
        cu_dev = torch.tensor(cu, dtype=torch.int32).to(dev)
    else:
        B, T, N, cu, cu_dev = len(seqlens), seqlens[0], len(seqlens), None, None
    x = cpu_inputs(gen, B, T, H, HV, K, N, l2norm_inside)
    scale = K ** -0.5
    ref = reference(x, scale, cu, l2norm_inside)
    d = {n: t.to(dev) for n, t in x.items()}
    what = "K=%d H=%d HV=%d %s%s" % (K, H, HV, ("varlen " + "+".join(map(str, seqlens))) if varlen else
                                     "B=%d T=%d" % (B, T), " l2norm" if l2norm_inside else "")
    try:
        o, ht = nan_like(x["v"], dev), nan_like(x["h0"], dev)
        C.chunk_fwd(d["q"], d["k"], d["v"], d["g"], d["beta"], o, scale=scale, initial_state=d["h0"],
                    final_state=ht, cu_seqlens=cu_dev, use_qk_l2norm=l2norm_inside,
                    workspace=workspace(C, "fwd", B, T, H, HV, K, N, dev), stream=stream)
        sync(dev)
        report("fwd " + what, {"o": rel(o, ref["o"]), "ht": rel(ht, ref["ht"])}, TOL)
    except Exception as e:
        print("sanitize_small: fwd %s raised %s: %s" % (what, type(e).__name__, e), flush=True)
        failures.append("fwd " + what)
    try:
        g = {n: nan_like(x[src], dev) for n, src in (("dq", "q"), ("dk", "k"), ("dv", "v"), ("dg", "g"),
                                                     ("dbeta", "beta"), ("dh0", "h0"))}
        C.chunk_bwd(d["q"], d["k"], d["v"], d["g"], d["beta"], d["do"], g["dq"], g["dk"], g["dv"], g["dg"],
                    g["dbeta"], scale=scale, initial_state=d["h0"], dfinal_state=d["dht"],
                    dinitial_state=g["dh0"], cu_seqlens=cu_dev, use_qk_l2norm=l2norm_inside,
                    workspace=workspace(C, "bwd", B, T, H, HV, K, N, dev), stream=stream)
        sync(dev)
        report("bwd " + what, {n: rel(g[n], ref[n]) for n in g}, TOL)
    except Exception as e:
        print("sanitize_small: bwd %s raised %s: %s" % (what, type(e).__name__, e), flush=True)
        failures.append("bwd " + what)


def recurrent_case(C, K, H, HV, T, stream, dev, N=3):
    """N = 3: a pool of P = 4 slots, 3 sequences with slots [2, -1 (padding), 0], T tokens
    each. Larger N (more items than resident warps, so that each warp of the persistent
    kernel reuses its stages): slots N-1 .. 0 in reverse, every 5th sequence padding,
    P = N + 1 (slot N and the padded sequences' slots unused)."""
    gen = torch.Generator().manual_seed(7 + K + T + N)
    if N == 3:
        P, idx = 4, [2, -1, 0]
    else:
        P, idx = N + 1, [-1 if n % 5 == 1 else N - 1 - n for n in range(N)]
    x = cpu_inputs(gen, N, T, H, HV, K, N, False)
    pool = torch.randn(P, HV, K, K, generator=gen)
    scale = K ** -0.5
    what = "recurrent K=%d H=%d HV=%d T=%d N=%d" % (K, H, HV, T, N)
    try:
        o = nan_like(x["v"], dev)
        pool_dev = pool.clone().to(dev)
        C.recurrent(x["q"].to(dev), x["k"].to(dev), x["v"].to(dev), x["g"].to(dev), x["beta"].to(dev),
                    pool_dev, o, scale=scale, state_indices=torch.tensor(idx, dtype=torch.int32).to(dev),
                    workspace=workspace(C, "recurrent", N, T, H, HV, K, N, dev), stream=stream)
        sync(dev)
        o, pool_out = o.cpu(), pool_dev.cpu()
        errs = {}
        o_ref, want_pool = R.recurrent(*(x[n].double().numpy() for n in ("q", "k", "v", "g", "beta")),
                                       pool.double().numpy(), state_indices=idx, scale=scale)
        o_ref, want_pool = torch.from_numpy(o_ref), torch.from_numpy(want_pool)
        errs["o"] = rel(o, o_ref)
        errs["ht"] = rel(pool_out, want_pool)
        unused = [s for s in range(P) if s not in idx]
        untouched = bool(torch.equal(pool_out[unused], pool[unused]))
        pad_zero = bool(all((o[n] == 0).all() for n in range(N) if idx[n] < 0))
        report(what, errs, TOL)
        print("sanitize_small: %-44s unused slots untouched %s, padding rows zero %s" % (
            what, untouched, pad_zero), flush=True)
        if not (untouched and pad_zero):
            failures.append(what + " (pool/padding)")
    except Exception as e:
        print("sanitize_small: %s raised %s: %s" % (what, type(e).__name__, e), flush=True)
        failures.append(what)


def run(C, dev, stream, quick):
    for K in ((128,) if quick else (64, 128)):
        chunk_case(C, K, 1, 2, [130], False, False, stream, dev)             # GVA, one sequence
        chunk_case(C, K, 2, 2, [1, 65, 64], True, not quick, stream, dev)   # varlen, length-1 seq
        recurrent_case(C, K, 1, 2, 1, stream, dev)                          # decode: one token
        recurrent_case(C, K, 1, 2, 2 if quick else 10, stream, dev)         # tokens past the first group of 4
    # more (sequence, head, 8-column) items than resident warps: each warp takes several
    recurrent_case(C, 128, 4, 32, 1, stream, dev, N=24)
    recurrent_case(C, 128, 4, 32, 5, stream, dev, N=24)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer cases (for racecheck)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("sanitize_small: no CUDA device; nothing to check")
        return 2
    try:
        import flashqla
        C = getattr(flashqla, "_C", None)
        if C is None:
            import flashqla._C as C  # noqa: F811
    except Exception:
        traceback.print_exc()
        print("sanitize_small: FAILED (flashqla not importable)")
        return 1
    if not C.cuda_built():
        print("sanitize_small: FAILED (flashqla built without CUDA)")
        return 1
    dev = torch.device("cuda", torch.cuda.current_device())
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        run(C, dev, s.cuda_stream, a.quick)
    if failures:
        print("sanitize_small: FAILED (%d): %s" % (len(failures), "; ".join(failures)), flush=True)
        return 1
    print("sanitize_small: ALL OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
