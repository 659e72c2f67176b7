#!/bin/bash
# dev/cuda/run_ncu_bwd.sh: Nsight Compute on the backward's kernels (bwd_wy, bwd_local,
# bwd_state; the sm_90a local kernels where they run) at check_bwd's first timing row
# (16/32 x 8192), clocks untouched: builds check_bwd as run_check_bwd.sh does, prints its
# stage table, then one launch per kernel (the second) with the details and per-instruction
# SASS pages as CSV in $OUT (ncu_<kernel>_details.csv, ncu_<kernel>_sass.csv) for reading on
# the development machine. FQ_NCU_KERNELS: which (default "bwd_wy bwd_local bwd_state").
set -u
OUTDIR=${OUT:-/tmp/out}; mkdir -p "$OUTDIR"
cd "$(dirname "$0")/../.." || exit 1
B=/tmp/fqbwdbuild; mkdir -p $B
NV="nvcc -std=c++17 -O3 -lineinfo --use_fast_math -Icsrc -gencode arch=compute_90a,code=sm_90a"
gcc -std=c11 -O2 -c csrc/gdn_common.c -o $B/gdn_common.o || exit 1
SRCS="dev/cuda/check_bwd.cu $(ls csrc/cuda/gdn_cuda_*.cu)"
for f in $SRCS; do $NV -Xcompiler -fopenmp -c $f -o $B/$(basename $f .cu).o & done; wait
OBJS=""; for f in $SRCS; do OBJS="$OBJS $B/$(basename $f .cu).o"; done
$NV -o $B/check_bwd $OBJS $B/gdn_common.o -lgomp || exit 1
echo "built in $SECONDS s"
OMP_NUM_THREADS=$(nproc) timeout 120 $B/check_bwd time 2>&1 | tail -8
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "ncu not found"; exit 1; }
for k in ${FQ_NCU_KERNELS:-bwd_wy bwd_local bwd_state}; do
  timeout 100 $NCU --clock-control none -k "regex:fq_${k}" --launch-skip 1 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
      --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SourceCounters \
      --import-source no -f -o /tmp/ncu_$k $B/check_bwd time > /tmp/ncu_$k.log 2>&1
  $NCU --import /tmp/ncu_$k.ncu-rep --page details --csv > "$OUTDIR/ncu_${k}_details.csv" 2>&1
  $NCU --import /tmp/ncu_$k.ncu-rep --page source --csv --print-source sass > "$OUTDIR/ncu_${k}_sass.csv" 2>&1
  echo "== $k at $SECONDS s: $(tail -1 /tmp/ncu_$k.log)"
done
