#!/usr/bin/env python3
"""Host overhead of one eager flashqla.gdn_recurrent call from PyTorch (decode, verify).

    python3 benchmarks/bench_host_overhead.py [--device cpu|cuda] [--N 16 | --N 1,64] [--H 16]
                                              [--HV 32] [--dim 128] [--threads 1]
                                              [--calls N] [--repeats R] [--json FILE]

Host time per call: `calls` calls issued back to back, timed on the host up to
the last one's return, then one synchronisation (not timed) before the next
repeat; the median (and min) over `repeats`. On CUDA the GPU does not bound
that time while its queue has room (a few hundred launches), so it is what
the host spends per eager call; the GPU time per call (CUDA events around the
same loop) is printed next to it.

  calls:  the public flashqla.gdn_recurrent at the decode shape (T = 1, a pool
          with int32 state_indices) and the speculative verify (T = 4,
          intermediate_states, update_state=False; its hot path is _C.recurrent_hot
          where torch has the DLPack C exchange API), the same hot path in Python
          (flashqla._torch.recurrent_hot, what a torch without that API runs),
          torch.ops.flashqla.recurrent (the custom op through the dispatcher),
          and flashqla._C.recurrent with
          its DLPack capsules made in the loop and made beforehand, and with the
          tensors themselves taken through torch's DLPack C exchange API
          (exchange_api=True, what the hot path does where torch has that API;
          the stream then read in C): the binding, the core and the launch alone.
  pieces: what such a call does besides the kernel, each timed alone (stream
          look-ups, allocations, one capsule, the trace check, a plain PyTorch
          op for scale).
  CPU:    the calls at the decode size and at a tiny size (1 sequence, 1 head,
          K = V = 16) where the kernel itself costs well under a microsecond,
          so the tiny number is the host overhead (Python front-end + binding).

Defaults: CUDA N = 1 and 64, bfloat16, 200 calls x 15 repeats (well under a
minute in all); CPU N = 16 and the tiny size, float32, 2000 calls x 7 repeats.
Speed is measured here, never asserted; results go to stdout (and --json FILE).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

try:
    import flashqla
except ImportError:  # run from a source tree built in place (setup.py build_ext --inplace)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import flashqla
from flashqla import _C

to_dlpack = torch.utils.dlpack.to_dlpack


def inputs(N, T, H, HV, K, V, device, dtype, verify=False):
    """The decode / verify inputs of bench_gpu.py: l2-normalised q, k, float32
    gates, a pool of N slots with int32 state_indices (and [N, T, HV, K, V]
    intermediate states for the verify)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(N, T, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(N, T, H, K, generator=gen), dim=-1)
    v = torch.randn(N, T, HV, V, generator=gen)
    g = -torch.rand(N, T, HV, generator=gen)
    b = torch.rand(N, T, HV, generator=gen)
    pool = torch.zeros(N, HV, K, V)
    idx = torch.arange(N, dtype=torch.int32)
    cast = lambda x: x.to(device=device, dtype=dtype)  # noqa: E731
    x = dict(q=cast(q), k=cast(k), v=cast(v), g=g.to(device), b=b.to(device), pool=pool.to(device),
             idx=idx.to(device), scale=K ** -0.5)
    x["o"] = torch.empty_like(x["v"])
    x["inter"] = torch.zeros((N, T, HV, K, V), device=device) if verify else None
    return x


def host_time(fn, calls, repeats, sync, prepare=None):
    """(median, min) host seconds per call; prepare(calls) -> the argument list
    of one repeat, made before its timed loop (pre-made capsules)."""
    for a in (prepare(20) if prepare else [None] * 20):
        fn(a)
    sync()
    times = []
    for _ in range(repeats):
        args = prepare(calls) if prepare else [None] * calls
        t0 = time.perf_counter()
        for a in args:
            fn(a)
        t1 = time.perf_counter()
        sync()
        times.append((t1 - t0) / calls)
    return statistics.median(times), min(times)


def gpu_time(fn, calls):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn(None)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def launch_kwargs(x):
    """stream= for a raw _C call on CUDA (the decode and verify need no workspace)."""
    q = x["q"]
    if not q.is_cuda:
        return {}
    return {"stream": torch.cuda.current_stream(q.device).cuda_stream}


def calls_of(x, threads, verify):
    """(name, fn(arg), prepare or None) of the call rows for inputs x."""
    from flashqla import _torch as ft
    q, k, v, g, b, pool, idx, o, scale = (x[n] for n in "q k v g b pool idx o scale".split())
    inter = x["inter"]
    c = to_dlpack
    kw = launch_kwargs(x)
    if not q.is_cuda and threads:
        kw["num_threads"] = threads
    if verify:
        kw.update(update_state=False)
        public = lambda _: flashqla.gdn_recurrent(q, k, v, g, b, pool, state_indices=idx,  # noqa: E731
                                                  intermediate_states=inter, update_state=False)
        op = lambda _: torch.ops.flashqla.recurrent(  # noqa: E731
            q, k, v, g, b, pool, idx, None, scale, False, inter, False, "kv", None, None, False, False)
        raw = lambda _: _C.recurrent(c(q), c(k), c(v), c(g), c(b), c(pool), c(o), scale=scale,  # noqa: E731
                                     state_indices=c(idx), intermediate_states=c(inter), **kw)
        pre = lambda a: _C.recurrent(*a[:7], scale=scale, state_indices=a[7],  # noqa: E731
                                     intermediate_states=a[8], **kw)
        xkw = {n: x for n, x in kw.items() if n != "stream"}
        xch = lambda _: _C.recurrent(q, k, v, g, b, pool, o, scale=scale, state_indices=idx,  # noqa: E731
                                     intermediate_states=inter, exchange_api=True, **xkw)
        made = (q, k, v, g, b, pool, o, idx, inter)
        pyhot = lambda _: ft.recurrent_hot(q, k, v, g, b, pool, idx, None, False, inter,  # noqa: E731
                                           False, "kv")
        name = f"verify T={q.shape[1]}"
    else:
        public = lambda _: flashqla.gdn_recurrent(q, k, v, g, b, pool, state_indices=idx)  # noqa: E731
        op = lambda _: torch.ops.flashqla.recurrent(  # noqa: E731
            q, k, v, g, b, pool, idx, None, scale, False, None, True, "kv", None, None, False, False)
        raw = lambda _: _C.recurrent(c(q), c(k), c(v), c(g), c(b), c(pool), c(o), scale=scale,  # noqa: E731
                                     state_indices=c(idx), **kw)
        pre = lambda a: _C.recurrent(*a[:7], scale=scale, state_indices=a[7], **kw)  # noqa: E731
        xkw = {n: x for n, x in kw.items() if n != "stream"}
        xch = lambda _: _C.recurrent(q, k, v, g, b, pool, o, scale=scale, state_indices=idx,  # noqa: E731
                                     exchange_api=True, **xkw)
        made = (q, k, v, g, b, pool, o, idx)
        pyhot = lambda _: ft.recurrent_hot(q, k, v, g, b, pool, idx, None, False)  # noqa: E731
        name = "decode T=1"
    premade = lambda n: [[c(t) for t in made] for _ in range(n)]  # noqa: E731
    rows = [(f"flashqla.gdn_recurrent {name}", public, None),
            (f"flashqla._torch.recurrent_hot {name} (the hot path in Python)", pyhot, None),
            (f"torch.ops.flashqla.recurrent {name}", op, None),
            (f"_C.recurrent {name}, capsules made in the loop", raw, None),
            (f"_C.recurrent {name}, capsules made before", pre, premade)]
    if _C.exchange_api(torch.Tensor):
        rows.append((f"_C.recurrent {name}, tensors (exchange_api=True)", xch, None))
    return rows


def pieces_of(x):
    """(name, fn(arg)) of what a call does besides the kernel, each alone."""
    from flashqla import _torch as ft
    from flashqla._frameworks import TORCH, scale_of
    q, v, idx = x["q"], x["v"], x["idx"]
    scratch = torch.empty(64, device=q.device)
    rows = [("to_dlpack(q): one capsule, made and dropped", lambda _: to_dlpack(q)),
            ("torch.empty_like(v): the output o", lambda _: torch.empty_like(v)),
            ("_plain_eager(): the trace / mode check", lambda _: ft._plain_eager()),
            ("scale_of(None, q)", lambda _: scale_of(None, q)),
            ("q.get_device() (the hot path's device check)", lambda _: q.get_device()),
            ("q.device != idx.device (before: the device check)", lambda _: q.device != idx.device),
            ("scratch.zero_(): one PyTorch eager op, for scale", lambda _: scratch.zero_()),
            ("torch._C._increment_version((pool,)): the written pool's version bump",
             lambda _: torch._C._increment_version((x["pool"],)))]
    if q.is_cuda:
        dev, dt = q.get_device(), str(q.dtype).replace("torch.", "")
        N, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        ws = _C.workspace_bytes("recurrent", N, T, H, HV, K, V, N, dt)
        rows += [
            ("torch.cuda.current_stream().cuda_stream", lambda _: torch.cuda.current_stream().cuda_stream),
            ("torch.cuda.current_stream(q.device).cuda_stream (before)",
             lambda _: torch.cuda.current_stream(q.device).cuda_stream),
            ("TORCH.cuda_stream(dev) (now: _cuda_getCurrentRawStream)", lambda _: TORCH.cuda_stream(dev)),
            ("_C.workspace_bytes('recurrent', ...) (before)",
             lambda _: _C.workspace_bytes("recurrent", N, T, H, HV, K, V, N, dt)),
            (f"torch.empty({ws}, uint8, device=q.device): the workspace (before)",
             lambda _: torch.empty(ws, dtype=torch.uint8, device=q.device)),
            ("TORCH.launch('recurrent', sizes): stream + workspace (before; now: with cu_seqlens)",
             lambda _: TORCH.launch("recurrent", q, (N, T, H, HV, K, V, N), dt)),
        ]
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--N", default=None, help="sequences, comma-separated (CUDA: 1,64; CPU: 16)")
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--HV", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128, help="K = V")
    ap.add_argument("--verify-T", type=int, default=4, help="tokens of the verify rows")
    ap.add_argument("--dtype", default=None, help="bfloat16 on CUDA, float32 on CPU by default")
    ap.add_argument("--threads", type=int, default=0,
                    help="CPU: num_threads of the raw _C path (0: FLASHQLA_NUM_THREADS or all cores; "
                         "the public path always uses that default)")
    ap.add_argument("--calls", type=int, default=None, help="calls per repeat (CUDA 200, CPU 2000)")
    ap.add_argument("--repeats", type=int, default=None, help="repeats (CUDA 15, CPU 7)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    cuda = a.device == "cuda"
    dtype = getattr(torch, a.dtype or ("bfloat16" if cuda else "float32"))
    import flashqla._torch  # noqa: F401  (registers torch.ops.flashqla.*; binds flashqla here)
    if cuda and not (torch.cuda.is_available() and flashqla.cuda_available()):
        print("bench_host_overhead: no CUDA device or flashqla built without CUDA", file=sys.stderr)
        return 2
    Ns = [int(n) for n in (a.N or ("1,64" if cuda else "16")).split(",")]
    calls = a.calls or (200 if cuda else 2000)
    repeats = a.repeats or (15 if cuda else 7)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sizes = [(f"N={N}", N, a.H, a.HV, a.dim, a.dim) for N in Ns]
    if not cuda:
        sizes.append(("tiny", 1, 1, 1, 16, 16))
    rows = {}

    def run(key, fn, prepare, n_calls, gpu):
        med, best = host_time(fn, n_calls, repeats, sync, prepare)
        row = {"median_us": med * 1e6, "min_us": best * 1e6}
        if gpu:
            row["gpu_us"] = gpu_time(fn, n_calls)
        rows[key] = row

    for label, N, H, HV, K, V in sizes:
        for verify in (False, True):
            x = inputs(N, a.verify_T if verify else 1, H, HV, K, V, a.device, dtype, verify)
            # CPU at decode size: the kernel dominates (T of them per call), fewer calls
            n = calls if cuda or label == "tiny" else max(5, calls // (50 * x["q"].shape[1]))
            for name, fn, prepare in calls_of(x, a.threads, verify):
                run(f"{label} {name}", fn, prepare, n, cuda and prepare is None)
        if label == ("N=%d" % Ns[0] if cuda else "tiny"):  # the pieces once, at the smallest size
            x = inputs(N, 1, H, HV, K, V, a.device, dtype)
            for name, fn in pieces_of(x):
                run(f"{label} piece {name}", fn, None, calls, False)

    dev = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"flashqla {flashqla.__version__}, torch {torch.__version__}, {dev}, {dtype}, H={a.H} "
          f"HV={a.HV} K=V={a.dim}, pool + int32 state_indices, verify T={a.verify_T}; host us per "
          f"call: median (min) of {repeats} repeats of back-to-back calls"
          + ("" if cuda else f"; CPU threads {_C.default_threads()} (raw path: {a.threads or 'default'})"))
    for key, row in rows.items():
        extra = f"   GPU {row['gpu_us']:9.2f}" if "gpu_us" in row else ""
        print(f"  {key:<86} {row['median_us']:9.2f} ({row['min_us']:8.2f}){extra}")
    if not cuda:
        # At the tiny size the kernel itself takes well under a microsecond: the
        # time per call is the host overhead. (Subtracting the C core's time at
        # decode size is not done: on a shared machine its noise is larger than
        # the overhead.)
        raw = rows.get("tiny _C.recurrent decode T=1, tensors (exchange_api=True)",
                       rows["tiny _C.recurrent decode T=1, capsules made in the loop"])["median_us"]
        for name in ("flashqla.gdn_recurrent", "torch.ops.flashqla.recurrent"):
            tiny = rows[f"tiny {name} decode T=1"]["median_us"]
            print(f"  host overhead of {name:<30} {tiny:8.2f} us per call, of which "
                  f"{tiny - raw:.2f} us above the binding's own {raw:.2f} us")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "device": dev, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
