#!/bin/bash
# dev/cuda/ncu_bwd_durations.sh: the duration of every kernel of one CUDA backward under
# Nsight Compute (gpu__time_duration, clocks and caches untouched: each kernel alone, the L2
# as the kernel before left it), at the shapes given (default: the 16/32 x 32768 and 8 x 4096
# rows), from `check_bwd one B T H HV` (one warm-up backward, then the profiled one). The
# binary is built here, on the development machine, and carried:
#   here:    bash dev/cuda/ncu_bwd_durations.sh build          -> .devbin_ncu/check_bwd.xz
#   device:  bash dev/cuda/ncu_bwd_durations.sh run ["1 32768 16 32" ...]   (carry [".devbin_ncu"])
# Prints, per shape, the kernels of the second backward in launch order with their durations (µs)
# and their sum.
set -u
MODE=${1:-run}
cd "$(dirname "$0")/../.." || exit 1
BIN=$PWD/.devbin_ncu
if [ "$MODE" = build ]; then
    rm -rf "$BIN"; mkdir -p "$BIN"
    B=/tmp/fq_ncu_bwd; rm -rf $B; mkdir -p $B
    NV="nvcc -std=c++17 -O3 -lineinfo --use_fast_math -gencode arch=compute_90a,code=sm_90a"
    gcc -std=c11 -O2 -Icsrc -c csrc/gdn_common.c -o $B/gdn_common.o || exit 1
    ls dev/cuda/check_bwd.cu csrc/cuda/gdn_cuda_*.cu |
        xargs -P 2 -I{} sh -c "$NV -Icsrc -Xcompiler -fopenmp -c {} -o $B/\$(basename {} .cu).o || echo FAIL {}"
    $NV -o "$BIN/check_bwd" $B/*.o -lgomp || exit 1
    xz -T2 -6 "$BIN/check_bwd" && ls -la "$BIN"
    exit 0
fi
. dev/cuda/devrun_lib.sh
fq_unpack_bins "$BIN" /tmp/fq_ncu_bin
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "ncu not found"; exit 1; }
shift
[ $# -gt 0 ] || set -- "1 32768 16 32" "8 4096 16 32"
for shape in "$@"; do
    echo "=== $shape (B T H HV)"
    OMP_NUM_THREADS=$(nproc) timeout 200 $NCU --clock-control none --cache-control none \
        --metrics gpu__time_duration.sum -k regex:fq_ --csv /tmp/fq_ncu_bin/check_bwd one $shape \
        > /tmp/ncu_dur.csv 2> /tmp/ncu_dur.err || { tail -5 /tmp/ncu_dur.err; continue; }
    python3 - /tmp/ncu_dur.csv <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
hdr = rows[0]; rows = rows[1:]
ki, vi, ui = hdr.index("Kernel Name"), hdr.index("Metric Value"), hdr.index("Metric Unit")
sc = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "ns": 1e-3, "us": 1.0, "ms": 1e3}
ks = [(r[ki], float(r[vi].replace(",", "")) * sc.get(r[ui], 1.0)) for r in rows]
half = ks[len(ks) // 2:]  # the second (profiled) backward: launches are the same twice
tot = 0.0
for name, us in half:
    short = name.split("(")[0].split("<")[0]
    tmpl = name[len(short):].split("(")[0]
    print(f"  {us:9.1f} us  {short}{tmpl[:40]}")
    tot += us
print(f"  {tot:9.1f} us  sum of {len(half)} kernels")
PY
done
