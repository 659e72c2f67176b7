#!/usr/bin/env python3
"""dev/cuda/prof_bwd_kernels.py: where one backward's time goes, kernel by kernel, for
flashqla and FlashQLA 0.1.3 on the same inputs (benchmarks/bench_gpu.py's adapters and input
sets: the backward alone given the forward's context). torch.profiler (CUPTI) timestamps,
median over 5 calls after 3 warm-up calls, per kernel name; each call's total is the sum of
its kernels (launch gaps excluded). Run on the device after the package is built, with
FlashQLA on PYTHONPATH (gpu_check.sh's FQ_PRE_CMD does both), e.g.
    python3 dev/cuda/prof_bwd_kernels.py 16 32 4096x8 16 32 32768 2 4 32768"""
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import torch  # noqa: E402

import bench_gpu as bg  # noqa: E402


def spec_of(H, HV, s):
    if "x" in s:
        T, n = (int(x) for x in s.split("x"))
        return dict(H=H, HV=HV, seqlens=[T] * n, layout="batch")
    return dict(H=H, HV=HV, seqlens=[int(s)], layout="single")


def profile(lib, t, reps=5, warm=3):
    st = lib.bwd_prepare(t)
    for _ in range(warm):
        lib.bwd(t, st)
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    per = {}
    totals = []
    with torch.profiler.profile(activities=acts) as prof:
        for i in range(reps):
            with torch.profiler.record_function(f"call{i}"):
                lib.bwd(t, st)
            torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    # kernels in launch order; split into calls by count (every call launches the same list)
    ks = [(e.name, e.time_range.start, e.time_range.end) for e in evs if "memcpy" not in e.name.lower()]
    ks.sort(key=lambda x: x[1])
    n = len(ks) // reps if reps else 0
    for i in range(reps):
        call = ks[i * n:(i + 1) * n]
        totals.append(sum(e - s for _, s, e in call) / 1000.0)
        if i == 0:
            span0 = (call[-1][2] - call[0][1]) / 1000.0 if call else 0
        for name, s, e in call:
            per.setdefault(name, []).append((e - s) / 1000.0)
    return per, statistics.median(totals), n, span0


def main():
    a = sys.argv[1:] or ["16", "32", "4096x8"]
    libs = [bg.Flashqla()]
    try:
        libs.append(bg.FlashQla())
    except Exception as e:  # FlashQLA not importable: flashqla alone
        print("FlashQLA:", bg.short_err(e))
    for i in range(0, len(a), 3):
        H, HV, s = int(a[i]), int(a[i + 1]), a[i + 2]
        spec = spec_of(H, HV, s)
        t = bg.chunk_sets("bwd", spec, 1)[0]
        for lib in libs:
            per, tot, n, span = profile(lib, t)
            print(f"=== {lib.name} bwd {H}/{HV} {s}: {n} kernels a call, kernel time {tot:.3f} ms "
                  f"(first call's span {span:.3f} ms)")
            for name, d in sorted(per.items(), key=lambda kv: -sum(kv[1])):
                cnt = len(d) // 5 or 1
                print(f"  {sum(d) / 5:8.3f} ms  x{cnt:<3d} {name[:110]}")


if __name__ == "__main__":
    main()
