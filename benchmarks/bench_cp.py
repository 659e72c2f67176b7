#!/usr/bin/env python3
"""Inter-card context parallelism, side by side: flashqla.distributed.gdn_chunk,
FLA's cp_context and FlashQLA's inter-card CP, one packed sequence split across
the GPUs of one host.

    torchrun --nproc_per_node=W benchmarks/bench_cp.py [--heads 16/64,16/32]
             [--tokens 1048576] [--reps 20] [--warmup 5] [--out DIR]

Status: written 2026-12-01 on a machine without GPUs and NOT RUN on GPUs yet
(no multi-GPU machine was lent). Its plumbing runs on CPUs with gloo
(`--device cpu --tokens 4096`, flashqla rows only), nothing more.

Rows, for each head configuration H/HV (K = V = 128, bf16 q, k, v; fp32 gates
as in ANCHORS.md: g = logsigmoid(randn)/16 with the first quarter of the value
heads g = 0, beta = sigmoid(randn)) and one sequence of --tokens tokens, rank r
holding tokens [r·TL, (r+1)·TL):

    flashqla            flashqla.distributed.gdn_chunk with h0 given and the
                        final state requested (exact)
    flashqla_no_state   the same without h0 / final state (FLA's conditions)
    fla_cp              FLA: chunk_gated_delta_rule(..., cp_context=build_cp_context(...));
                        FLA refuses h0 / final state under CP
    flash_qla_cp        FlashQLA (Qwen): chunk_gated_delta_rule(..., cp_context=...)
                        from its build_cp_context(enable_inter=True, enable_intra=True)
                        when the installed flash_qla has it (it truncates at a
                        cumulative gate of -10)

Passes: "fwd" (forward, no autograd) and "train" (forward + backward of
<o, do> (+ <ht, dht>)). Timing: eager calls (NCCL collectives inside, so no
CUDA graph), CUDA events around each call after a barrier, median over --reps
after --warmup; the row's time is the slowest rank's median (all_reduce MAX).
Peak device memory per rank (max over ranks) is recorded.

Checks, recorded beside the times: flashqla.distributed against the
single-GPU flashqla.gdn_chunk on rank 0 at W·4096 tokens (rel error of o, ht,
dq, dk, dv, dg, dbeta, dh0 from a gathered copy of the stream), and every other
library's o against flashqla's o at the benchmark size (rel error, max over
ranks). A library that is missing or fails gets its reason in the JSON.

FlashQLA published (H200 x 8, 16/64, 1M tokens, forward): FLA kcp 26.1 ms,
FlashQLA dual 9.2 ms; training step: FLA N/A (its CP refused GVA training
there), FlashQLA 31.2 ms (benchmark_cp_results_H200x8.txt in its repository).

Writes DIR/cp_<gpu>x<W>_<date>.json (rank 0) and copies it to $OUT when set.
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import shutil
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
K_DIM = V_DIM = 128
PUBLISHED = {"16/64": {"fwd": {"fla_cp": 26.145, "flash_qla_cp": 9.201},
                       "train": {"fla_cp": None, "flash_qla_cp": 31.151}}}


def log(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


def short_err(e, n=400):
    s = f"{type(e).__name__}: {e}"
    return s if len(s) <= n else s[:n] + "..."


def rel(a, b):
    a, b = a.double(), b.double()
    den = torch.linalg.vector_norm(b).item()
    return torch.linalg.vector_norm(a - b).item() / den if den > 0 else float("inf")


def reduce_max(x, device):
    t = torch.tensor([float(x)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


# ---------------------------------------------------------------- inputs ----

def make_inputs(TL, H, HV, rank, device, seed=0, h0=True):
    """This rank's slice (its own random stream: the slices of one sequence)."""
    gen = torch.Generator(device=device).manual_seed(seed * 1000 + rank)
    bf = torch.bfloat16 if device.type == "cuda" else torch.float32

    def normed(*shape):
        return F.normalize(torch.randn(*shape, generator=gen, device=device), dim=-1).to(bf)

    q, k = normed(1, TL, H, K_DIM), normed(1, TL, H, K_DIM)
    v = torch.randn(1, TL, HV, V_DIM, generator=gen, device=device).to(bf)
    g = F.logsigmoid(torch.randn(1, TL, HV, generator=gen, device=device)) / 16
    g[:, :, : HV // 4] = 0
    beta = torch.sigmoid(torch.randn(1, TL, HV, generator=gen, device=device))
    state = (torch.randn(1, HV, K_DIM, V_DIM, generator=gen, device=device) * 0.1) if h0 else None
    do = torch.randn(1, TL, HV, V_DIM, generator=gen, device=device).to(bf)
    dht = torch.randn(1, HV, K_DIM, V_DIM, generator=gen, device=device) * 0.1
    return dict(q=q, k=k, v=v, g=g.contiguous(), beta=beta, h0=state, do=do, dht=dht)


# -------------------------------------------------------------- libraries ----

class Flashqla:
    name = "flashqla"

    def __init__(self, states=True):
        import flashqla
        import flashqla.distributed
        self.fn = flashqla.distributed.gdn_chunk
        self.states = states
        self.version = flashqla.__version__
        if not states:
            self.name = "flashqla_no_state"

    def __call__(self, t, cu, group):
        return self.fn(t["q"], t["k"], t["v"], t["g"], t["beta"], group=group, cu_seqlens=cu,
                       initial_state=t["h0"] if self.states else None,
                       output_final_state=self.states)


class FlaCp:
    """FLA's KCP: chunk_gated_delta_rule with a cp_context (no h0 / final state)."""
    name = "fla_cp"
    states = False

    def __init__(self):
        os.environ.setdefault("FLA_FLASH_QLA", "0")   # FLA's own Triton kernels
        os.environ.setdefault("FLA_TILELANG", "0")
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        if "cp_context" not in inspect.signature(chunk_gated_delta_rule).parameters:
            raise RuntimeError(f"fla {fla.__version__}: chunk_gated_delta_rule has no cp_context")
        from fla.ops.cp import build_cp_context
        self.fn, self.build, self.version = chunk_gated_delta_rule, build_cp_context, fla.__version__
        self.ctx = None

    def __call__(self, t, cu, group):
        if self.ctx is None:  # built once (it reads cu_seqlens on the host)
            self.ctx = self.build(cu, group=group)
        o, _ = self.fn(t["q"], t["k"], t["v"], t["g"], t["beta"], cp_context=self.ctx)
        return o, None


class FlashQlaCp:
    """Qwen's FlashQLA, inter-card + intra-card CP (truncated at a gate sum of -10)."""
    name = "flash_qla_cp"
    states = False

    def __init__(self, train):
        import flash_qla
        fn = flash_qla.chunk_gated_delta_rule
        if "cp_context" not in inspect.signature(fn).parameters:
            raise RuntimeError(f"flash_qla {getattr(flash_qla, '__version__', '?')}: "
                               f"chunk_gated_delta_rule has no cp_context (no inter-card CP)")
        from flash_qla.ops.gated_delta_rule.chunk.cp.context import build_cp_context
        self.fn, self.build, self.train = fn, build_cp_context, train
        self.version = getattr(flash_qla, "__version__", None)
        self.ctx = None

    def __call__(self, t, cu, group):
        if self.ctx is None:
            self.ctx = self.build(cu, enable_inter=True, enable_intra=True, group=group,
                                  num_v_heads=int(t["v"].shape[2]), chunk_size=64,
                                  is_train=self.train)
        o, _ = self.fn(t["q"], t["k"], t["v"], t["g"], t["beta"], cp_context=self.ctx)
        return o, None


# ----------------------------------------------------------------- timing ----

def timed(fn, reps, warmup, device):
    """Median ms of fn() over reps calls, each after a barrier (events on CUDA)."""
    times = []
    for i in range(warmup + reps):
        dist.barrier()
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ms = a.elapsed_time(b)
        else:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
    return statistics.median(times)


def run_pass(lib, t, cu, group, pass_, reps, warmup, device):
    if pass_ == "fwd":
        def step():
            with torch.no_grad():
                lib(t, cu, group)
    else:
        leaves = {n: t[n].detach().requires_grad_() for n in ("q", "k", "v", "g", "beta")}
        if lib.states and t["h0"] is not None:
            leaves["h0"] = t["h0"].detach().requires_grad_()
        x = dict(t, **leaves)

        def step():
            o, ht = lib(x, cu, group)
            loss = (o.float() * x["do"].float()).sum()
            if ht is not None:
                loss = loss + (ht * x["dht"]).sum()
            loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    ms = timed(step, reps, warmup, device)
    mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return ms, mem


# ----------------------------------------------------------------- checks ----

def check_exact(H, HV, world, rank, device, group):
    """flashqla.distributed against the single-device call on rank 0, W·4096 tokens."""
    import flashqla
    import flashqla.distributed
    TL = 4096
    full = make_inputs(world * TL, H, HV, 0, device, seed=77)  # the same stream on every rank
    sl = slice(rank * TL, (rank + 1) * TL)
    cu = torch.tensor([0, world * TL], device=device)
    names = ("q", "k", "v", "g", "beta")
    x = {n: full[n][:, sl].detach().clone().requires_grad_() for n in names}
    h0 = full["h0"].detach().clone().requires_grad_()
    o, ht = flashqla.distributed.gdn_chunk(*(x[n] for n in names), initial_state=h0,
                                           output_final_state=True, cu_seqlens=cu, group=group)
    loss = (o.float() * full["do"][:, sl].float()).sum()
    if rank == world - 1:
        loss = loss + (ht * full["dht"]).sum()
    loss.backward()
    got = {"o": o, "dq": x["q"].grad, "dk": x["k"].grad, "dv": x["v"].grad, "dg": x["g"].grad,
           "dbeta": x["beta"].grad}
    gathered = {}
    for n, val in got.items():
        buf = torch.empty((world,) + tuple(val.shape), dtype=val.dtype, device=device)
        dist.all_gather_into_tensor(buf.view(-1), val.contiguous().view(-1), group=group)
        gathered[n] = torch.cat(list(buf), dim=1)
    dh0 = h0.grad.clone()
    dist.all_reduce(dh0, group=group)
    ht_last = ht.clone()
    dist.broadcast(ht_last, src=world - 1, group=group)
    if rank != 0:
        return None
    y = {n: full[n].detach().clone().requires_grad_() for n in names}
    h1 = full["h0"].detach().clone().requires_grad_()
    o1, ht1 = flashqla.gdn_chunk(*(y[n] for n in names), initial_state=h1,
                                 output_final_state=True, cu_seqlens=cu)
    ((o1.float() * full["do"].float()).sum() + (ht1 * full["dht"]).sum()).backward()
    ref = {"o": o1, "dq": y["q"].grad, "dk": y["k"].grad, "dv": y["v"].grad, "dg": y["g"].grad,
           "dbeta": y["beta"].grad}
    out = {n: rel(gathered[n], ref[n]) for n in ref}
    out["ht"] = rel(ht_last, ht1)
    out["dh0"] = rel(dh0, h1.grad)
    return out


# ------------------------------------------------------------------- main ----

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="16/64", help="comma-separated H/HV, e.g. 16/64,16/32")
    ap.add_argument("--tokens", type=int, default=1 << 20, help="tokens of the whole sequence")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--passes", default="fwd,train")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: gloo plumbing test of the flashqla rows")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()

    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    group, world, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    if args.tokens % world:
        raise SystemExit(f"--tokens {args.tokens} is not a multiple of the world size {world}")
    TL = args.tokens // world
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    log(f"== {world} x {gpu}, {args.tokens} tokens ({TL} per rank), K = V = {K_DIM}")

    result = {"date": datetime.date.today().isoformat(), "device": gpu, "world": world,
              "tokens": args.tokens, "tokens_per_rank": TL, "torch": torch.__version__,
              "timing": "eager, CUDA events after a barrier, median; slowest rank",
              "published_flash_qla_h200x8": PUBLISHED, "configs": []}
    passes = args.passes.split(",")
    for heads in args.heads.split(","):
        H, HV = (int(x) for x in heads.split("/"))
        cfg = {"heads": heads, "H": H, "HV": HV, "rows": [], "missing": {}}
        try:
            cfg["check_vs_single_device"] = check_exact(H, HV, world, rank, device, group)
        except Exception as e:
            cfg["check_vs_single_device"] = {"error": short_err(e)}
            traceback.print_exc()
        t = make_inputs(TL, H, HV, rank, device)
        cu = torch.tensor([0, args.tokens], device=device)
        o_ours = None
        for pass_ in passes:
            makers = [("flashqla", lambda: Flashqla(True)),
                      ("flashqla_no_state", lambda: Flashqla(False)),
                      ("fla_cp", FlaCp),
                      ("flash_qla_cp", lambda: FlashQlaCp(pass_ == "train"))]
            for name, make in makers:
                try:
                    lib = make()
                except Exception as e:  # not installed / no CP: recorded per pass
                    cfg["missing"][f"{name}:{pass_}"] = short_err(e)
                    log(f"{heads:>6} {pass_:>5} {name:>18}: missing ({short_err(e, 120)})")
                    continue
                row = {"library": lib.name, "version": lib.version, "pass": pass_}
                try:
                    with torch.no_grad():
                        o, _ = lib(t, cu, group)
                    if lib.name == "flashqla_no_state" and o_ours is None:
                        o_ours = o.clone()
                    elif o_ours is not None and lib.name in ("fla_cp", "flash_qla_cp"):
                        row["o_rel_vs_flashqla"] = reduce_max(rel(o, o_ours), device)
                    del o
                    ms, mem = run_pass(lib, t, cu, group, pass_, args.reps, args.warmup, device)
                    row["ms"] = reduce_max(ms, device)
                    row["peak_gib"] = None if mem is None else reduce_max(mem, device)
                except Exception as e:
                    row["error"] = short_err(e)
                    traceback.print_exc()
                cfg["rows"].append(row)
                log(f"{heads:>6} {pass_:>5} {row['library']:>18}: "
                    + (f"{row['ms']:9.3f} ms" if "ms" in row else row.get("error", "")))
        result["configs"].append(cfg)
        del t

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        tag = gpu.replace("NVIDIA ", "").replace(" ", "_").lower()
        path = os.path.join(args.out, f"cp_{tag}x{world}_{result['date']}.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        log(f"== wrote {path}")
        if os.environ.get("OUT"):
            shutil.copy(path, os.environ["OUT"])
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
