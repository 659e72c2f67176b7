#!/bin/bash
# dev/cuda/run_rev_first.sh: the first device run of a new backward kernel, cheapest
# failure first (carry [".devbin_bwd"], binaries from dev/cuda/run_ab_bwd.sh build):
# B's small cases (a hang or a wrong kernel shows in 60 s), then B's full check,
# A's and B's timings, FLASHQLA_CUDA_BWD_REVERSE=0 small cases of B (its older path),
# compute-sanitizer memcheck + racecheck of B's small cases. Logs in $OUT.
set -u
OUTDIR=${OUT:-/tmp/out}; mkdir -p "$OUTDIR"
cd "$(dirname "$0")/../.." || exit 1
. dev/cuda/devrun_lib.sh
BIN=/tmp/fq_rev_bin
fq_unpack_bins .devbin_bwd $BIN
export OMP_NUM_THREADS=$(nproc)
T0=$(date +%s)
echo "=== B small"
timeout 60 $BIN/check_bwd_b small > $OUTDIR/b_small.log 2>&1; rc=$?
echo "(exit $rc at $(( $(date +%s) - T0 )) s)"; grep -E "rel|FAIL|ok|error" $OUTDIR/b_small.log | tail -25
[ $rc = 0 ] || { echo "B small failed: stop"; exit 1; }
echo "=== B full"
timeout 150 $BIN/check_bwd_b > $OUTDIR/check_b.log 2>&1; echo "(exit $? at $(( $(date +%s) - T0 )) s)"
grep -E "FAIL|error" $OUTDIR/check_b.log | head -20
sed -n '/==== summary/,$p' $OUTDIR/check_b.log | head -24
echo "=== A timings"
timeout 90 $BIN/check_bwd_a time > $OUTDIR/time_a.log 2>&1; echo "(exit $? at $(( $(date +%s) - T0 )) s)"
echo "=== B small, FLASHQLA_CUDA_BWD_REVERSE=0"
FLASHQLA_CUDA_BWD_REVERSE=0 timeout 60 $BIN/check_bwd_b small 2>&1 | tail -4
echo "=== B memcheck and racecheck, small"
fq_sanitize_pair "$OUTDIR/b" 100 $BIN/check_bwd_b small small
echo "=== per row (ms): total rec loc st wy  (A, B) at $(( $(date +%s) - T0 )) s"
for f in time_a check_b; do echo "--- $f"; sed -n '/^shape /,/^$/p' $OUTDIR/$f.log | grep -v "^$" | head -8; done
