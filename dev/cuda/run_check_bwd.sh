#!/bin/bash
# Build and run dev/cuda/check_bwd.cu on a GPU machine (from the repo root):
# correctness of the CUDA backward (csrc/cuda/gdn_cuda_bwd.cu) against the float64
# reference and timings of the ANCHORS.md backward rows, with a summary
# table; then the small cases with each configuration of the reverse state
# pass forced (FLASHQLA_CUDA_BWD_STATE); then compute-sanitizer memcheck and
# racecheck on the small subset. Logs go to $OUT if set. About 2 min.
set -u
OUTDIR=${OUT:-/tmp}
B=/tmp/fqbwdbuild; mkdir -p $B
T0=$(date +%s)
NV="nvcc -std=c++17 -O3 -lineinfo --use_fast_math -Icsrc -gencode arch=compute_90a,code=sm_90a"
gcc -std=c11 -O2 -c csrc/gdn_common.c -o $B/gdn_common.o || exit 1
pids=""
SRCS="dev/cuda/check_bwd.cu $(ls csrc/cuda/gdn_cuda_*.cu)"  # every library kernel file, as setup.py builds them
for f in $SRCS; do
  $NV -Xcompiler -fopenmp -Xptxas -v -c $f -o $B/$(basename $f .cu).o > $B/$(basename $f .cu).log 2>&1 &
  pids="$pids $!"
done
fail=0; for p in $pids; do wait $p || fail=1; done
echo "=== ptxas (backward files): spills / registers"
cat $B/gdn_cuda_bwd*.log | grep -E "error|spill|registers" | sort | uniq -c | head -20
[ $fail = 0 ] || { cat $B/*.log | grep -B2 -A5 error | head -60; exit 1; }
OBJS=""; for f in $SRCS; do OBJS="$OBJS $B/$(basename $f .cu).o"; done
$NV -o $B/check_bwd $OBJS $B/gdn_common.o -lgomp || exit 1
echo "=== built in $(( $(date +%s) - T0 )) s"
echo "=== full check + timings"
OMP_NUM_THREADS=$(nproc) timeout 100 $B/check_bwd 2>&1 | tee $OUTDIR/check_bwd.log
echo "=== exit status ${PIPESTATUS[0]} at $(( $(date +%s) - T0 )) s"
echo "=== each bwd_state configuration forced (the small cases pick ks 2, bv 16)"
for cfg in 16:1 32:1 32:2 64:1 64:2; do
  echo "--- FLASHQLA_CUDA_BWD_STATE=$cfg"
  FLASHQLA_CUDA_BWD_STATE=$cfg OMP_NUM_THREADS=$(nproc) timeout 30 $B/check_bwd small 2>&1 | tail -3
done
echo "--- FLASHQLA_CUDA_BWD_SM90=0 (the mma.sync local kernels, as off sm_90a)"
FLASHQLA_CUDA_BWD_SM90=0 OMP_NUM_THREADS=$(nproc) timeout 60 $B/check_bwd small 2>&1 | tail -3
if command -v compute-sanitizer >/dev/null; then
  echo "=== memcheck, small"
  timeout 40 compute-sanitizer --tool memcheck $B/check_bwd small 2>&1 | tail -6 | tee $OUTDIR/memcheck_bwd.log
  echo "=== racecheck, small"
  timeout 40 compute-sanitizer --tool racecheck $B/check_bwd small 2>&1 | tail -6 | tee $OUTDIR/racecheck_bwd.log
fi
echo "=== done at $(( $(date +%s) - T0 )) s"
exit 0
