#!/usr/bin/env python3
"""dev/cuda/time_bwd_dispatch.py: the backward alone (benchmarks/bench_gpu.py's flashqla adapter
and input sets) at shapes around fq_bwd_rev_path's threshold (N * HV >= 110 per wave of 132),
to check the dispatch rule against measurement. FLASHQLA_CUDA_BWD_REVERSE is read once per
process, so run it once per setting, e.g. on the device after the package is built:
    for r in 0 1 auto; do FLASHQLA_CUDA_BWD_REVERSE=$r python3 dev/cuda/time_bwd_dispatch.py; done
Arguments: H HV seqlens-spec triples as in prof_bwd_kernels.py (T or TxN); default a ladder."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

import bench_gpu as bg  # noqa: E402
from prof_bwd_kernels import spec_of  # noqa: E402

# N * HV from 40 to 256 at HV = 4, 8, 16, 32 (one wave = 132)
LADDER = [x for H, HV, ns in ((16, 32, (2, 3, 4, 5, 8)), (8, 16, (4, 6, 8, 12)), (4, 8, (5, 6, 9, 12, 16, 20, 32)),
                              (2, 4, (16, 24, 33, 48)))
          for n in ns for x in (str(H), str(HV), f"4096x{n}")]


def main():
    a = sys.argv[1:] or LADDER
    lib = bg.Flashqla()
    mode = os.environ.get("FLASHQLA_CUDA_BWD_REVERSE", "auto")
    for i in range(0, len(a), 3):
        H, HV, s = int(a[i]), int(a[i + 1]), a[i + 2]
        spec = spec_of(H, HV, s)
        sets = bg.chunk_sets("bwd", spec, 2)
        sts = [lib.bwd_prepare(t) for t in sets]
        fns = [(lambda t=t, st=st: lib.bwd(t, st)) for t, st in zip(sets, sts)]
        r = bg.time_calls(fns, 20)
        n = len(spec["seqlens"])
        print(f"REVERSE={mode:4s} bwd {H}/{HV} {s:>8s} N*HV={n * HV:4d}: {r['ms']:.3f} ms "
              f"(min {r['ms_min']:.3f}, {r['method'][:5]})", flush=True)
        del sets, sts, fns
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
