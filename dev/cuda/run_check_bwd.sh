#!/bin/bash
# Build and run dev/cuda/check_bwd.cu on a GPU machine (from the repo root):
# correctness of the backward versions v1..v4 (see csrc/gdn_cuda_bwd.cu)
# against the float64 reference, timings of the ANCHORS.md backward rows for
# each, a summary table; then the unmeasured experiment v5 against v3 in a
# separate process (a fault there cannot hide the main table); then
# compute-sanitizer memcheck and racecheck on the small subset (all
# versions). Logs go to $OUT if set. About 2.5 min (at most 4).
set -u
OUTDIR=${OUT:-/tmp}
B=/tmp/fqbwdbuild; mkdir -p $B
T0=$(date +%s)
NV="nvcc -std=c++17 -O3 -lineinfo --use_fast_math -Icsrc -gencode arch=compute_90a,code=sm_90a"
gcc -std=c11 -O2 -c csrc/gdn_common.c -o $B/gdn_common.o || exit 1
pids=""
SRCS="dev/cuda/check_bwd.cu $(ls csrc/gdn_cuda_bwd*.cu csrc/gdn_cuda_fwd*.cu)"
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
echo "=== full check + timings, measured versions v1..v4 (v3 = default)"
OMP_NUM_THREADS=$(nproc) timeout 100 $B/check_bwd versions=1234 2>&1 | tee $OUTDIR/check_bwd.log
echo "=== exit status ${PIPESTATUS[0]} at $(( $(date +%s) - T0 )) s"
echo "=== experiments v5 (bwd_state2), v6 (bwd_state3) against v3, separate process"
OMP_NUM_THREADS=$(nproc) timeout 90 $B/check_bwd versions=356 2>&1 | tee $OUTDIR/check_bwd_v5.log
echo "=== exit status ${PIPESTATUS[0]} at $(( $(date +%s) - T0 )) s"
echo "=== v6 with each bwd_state3 configuration forced (the small cases pick ks 2, bv 16)"
for cfg in 16:1 32:1 32:2 64:1 64:2; do
  echo "--- FLASHQLA_CUDA_BWD_STATE=$cfg"
  FLASHQLA_CUDA_BWD_STATE=$cfg OMP_NUM_THREADS=$(nproc) timeout 30 $B/check_bwd small versions=6 2>&1 | tail -3
done
if command -v compute-sanitizer >/dev/null; then
  echo "=== memcheck, small (all versions)"
  timeout 40 compute-sanitizer --tool memcheck $B/check_bwd small versions=123456 2>&1 | tail -6 | tee $OUTDIR/memcheck_bwd.log
  echo "=== racecheck, small (all versions)"
  timeout 40 compute-sanitizer --tool racecheck $B/check_bwd small versions=123456 2>&1 | tail -6 | tee $OUTDIR/racecheck_bwd.log
fi
echo "=== done at $(( $(date +%s) - T0 )) s"
exit 0
