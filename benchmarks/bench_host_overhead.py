#!/usr/bin/env python3
"""Host overhead of one eager flashqla.gdn_recurrent call from PyTorch (decode).

    python3 benchmarks/bench_host_overhead.py [--device cpu|cuda] [--N 16] [--H 16] [--HV 32]
                                              [--dim 128] [--threads 1] [--calls 2000]

What it prints, per path (public gdn_recurrent, torch.ops.flashqla.recurrent,
and flashqla._C.recurrent on prebuilt tensors with capsules made in the loop):

  CPU:  the median (over repeats) wall time per call at the decode size and at
        a tiny size (1 sequence, 1 head, K = V = 16) where the kernel itself
        costs well under a microsecond, so the tiny number is the host
        overhead (Python front-end + binding), printed last.
  CUDA: host time per call = wall time of a loop of enqueues divided by the
        calls, with one synchronisation at the end (while the GPU keeps up,
        that is the host's cost), and the GPU time per call from CUDA events
        around the same loop; a host time below the GPU time means the GPU,
        not the host, bounds decoding.

Speed is measured here, never asserted; results go to stdout (and --json FILE).
"""
import argparse
import json
import statistics
import sys
import time

import torch

import flashqla
from flashqla import _C


def inputs(N, H, HV, K, V, device, dtype):
    gen = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(N, 1, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(N, 1, H, K, generator=gen), dim=-1)
    v = torch.randn(N, 1, HV, V, generator=gen)
    g = -torch.rand(N, 1, HV, generator=gen)
    b = torch.rand(N, 1, HV, generator=gen)
    pool = torch.zeros(N + 1, HV, K, V)
    idx = torch.arange(N, dtype=torch.int32)
    cast = lambda x: x.to(device=device, dtype=dtype)  # noqa: E731
    return (cast(q), cast(k), cast(v), g.to(device), b.to(device), pool.to(device),
            idx.to(device))


def per_call(fn, calls, repeats, sync):
    for _ in range(20):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times), min(times)


def paths(x, scale, threads):
    q, k, v, g, b, pool, idx = x
    o = torch.empty_like(v)
    c = torch.utils.dlpack.to_dlpack
    launch = {}
    if q.is_cuda:
        n = _C.workspace_bytes("recurrent", q.shape[0], 1, q.shape[2], v.shape[2], q.shape[3],
                               v.shape[3], q.shape[0], str(q.dtype).replace("torch.", ""))
        ws = torch.empty(n, dtype=torch.uint8, device=q.device) if n else None
        stream = torch.cuda.current_stream().cuda_stream
        launch = {"stream": stream}
        raw = lambda: _C.recurrent(c(q), c(k), c(v), c(g), c(b), c(pool), c(o), scale=scale,  # noqa: E731
                                   state_indices=c(idx), workspace=None if ws is None else c(ws),
                                   **launch)
    else:
        raw = lambda: _C.recurrent(c(q), c(k), c(v), c(g), c(b), c(pool), c(o), scale=scale,  # noqa: E731
                                   state_indices=c(idx), num_threads=threads)
    return {
        "flashqla.gdn_recurrent": lambda: flashqla.gdn_recurrent(q, k, v, g, b, pool,
                                                                 state_indices=idx),
        "torch.ops.flashqla.recurrent": lambda: torch.ops.flashqla.recurrent(
            q, k, v, g, b, pool, idx, None, scale, False, None, True, "kv", None, None, False, False),
        "flashqla._C.recurrent (capsules)": raw,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--N", type=int, default=16, help="sequences (one token each)")
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--HV", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128, help="K = V")
    ap.add_argument("--dtype", default=None, help="bfloat16 on CUDA, float32 on CPU by default")
    ap.add_argument("--threads", type=int, default=0,
                    help="CPU: num_threads of the raw _C path (0: FLASHQLA_NUM_THREADS or all cores; "
                         "the public path always uses that default)")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    dtype = getattr(torch, a.dtype or ("bfloat16" if a.device == "cuda" else "float32"))
    if a.device == "cuda" and not (torch.cuda.is_available() and flashqla.cuda_available()):
        print("bench_host_overhead: no CUDA device or flashqla built without CUDA", file=sys.stderr)
        return 2
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    import flashqla._torch  # noqa: F401  (registers torch.ops.flashqla.*)
    rows = {}
    sizes = {"decode": (a.N, a.H, a.HV, a.dim, a.dim), "tiny": (1, 1, 1, 16, 16)}
    for size, (N, H, HV, K, V) in sizes.items():
        x = inputs(N, H, HV, K, V, a.device, dtype)
        for name, fn in paths(x, K ** -0.5, a.threads).items():
            calls = a.calls if size == "tiny" or a.device == "cuda" else max(20, a.calls // 50)
            med, best = per_call(fn, calls, a.repeats, sync)
            row = {"median_us": med * 1e6, "min_us": best * 1e6}
            if a.device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(calls):
                    fn()
                end.record()
                torch.cuda.synchronize()
                row["gpu_us"] = start.elapsed_time(end) * 1e3 / calls
            rows[f"{size} {name}"] = row
    print(f"flashqla {flashqla.__version__}, torch {torch.__version__}, device {a.device}, "
          f"{dtype}, decode N={a.N} H={a.H} HV={a.HV} K=V={a.dim} T=1; CPU threads "
          f"{_C.default_threads()} (raw path: {a.threads or 'default'})")
    for name, row in rows.items():
        extra = f"   GPU {row['gpu_us']:8.2f} us/call" if "gpu_us" in row else ""
        print(f"  {name:<44} {row['median_us']:9.2f} us/call (min {row['min_us']:8.2f}){extra}")
    if a.device == "cpu":
        # At the tiny size the kernel itself takes well under a microsecond: the
        # time per call is the host overhead. (Subtracting the C core's time at
        # decode size is not done: on a shared machine its noise is larger than
        # the overhead.)
        raw = rows["tiny flashqla._C.recurrent (capsules)"]["median_us"]
        for name in ("flashqla.gdn_recurrent", "torch.ops.flashqla.recurrent"):
            tiny = rows[f"tiny {name}"]["median_us"]
            print(f"  host overhead of {name:<30} {tiny:8.2f} us per call, of which "
                  f"{tiny - raw:.2f} us above the binding's own {raw:.2f} us")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
