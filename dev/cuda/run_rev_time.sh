#!/bin/bash
# dev/cuda/run_rev_time.sh: the full check of check_bwd_$FQ_FULL (default b), then the
# timings of every carried check_bwd_[a-s] (A = the baseline), then `one 8 4096 16 32` of
# each traced build (check_bwd_t*, built with -DFQ_REV_TRACE: bwd_rev90's per-role clock
# trace); FQ_SAN=1: compute-sanitizer memcheck + racecheck of FQ_FULL's small cases.
set -u
OUTDIR=${OUT:-/tmp/out}; mkdir -p "$OUTDIR"
cd "$(dirname "$0")/../.." || exit 1
. dev/cuda/devrun_lib.sh
BIN=/tmp/fq_rev_bin
fq_unpack_bins .devbin_bwd $BIN
export OMP_NUM_THREADS=$(nproc)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
T0=$(date +%s)
echo "=== ${FQ_FULL:-b} full"
timeout 150 $BIN/check_bwd_${FQ_FULL:-b} > $OUTDIR/check_b.log 2>&1; echo "(exit $? at $(( $(date +%s) - T0 )) s)"
grep -E "FAIL|error" $OUTDIR/check_b.log | head -20
sed -n '/==== summary/,/^times/p' $OUTDIR/check_b.log | grep -E "ok|FAIL" | awk '{print $NF, $(NF-1)}' | sort | uniq -c | head
for x in $(ls $BIN | grep -E '^check_bwd_[ac-s]$'); do
    echo "=== ${x#check_bwd_}: timings"
    timeout 90 $BIN/$x time > $OUTDIR/time_${x#check_bwd_}.log 2>&1; echo "(exit $? at $(( $(date +%s) - T0 )) s)"
done
for x in $(ls $BIN | grep -E '^check_bwd_t[a-z]*$'); do
    echo "=== $x: trace"
    timeout 60 $BIN/$x one 8 4096 16 32 > $OUTDIR/$x.trace 2>&1
    python3 dev/cuda/trace_rev.py < $OUTDIR/$x.trace
done
if [ -n "${FQ_SAN:-}" ]; then
    echo "=== ${FQ_FULL:-b} memcheck and racecheck, small"
    fq_sanitize_pair "$OUTDIR/san" 100 $BIN/check_bwd_${FQ_FULL:-b} small small
fi
echo "=== per row (ms): total rec loc st wy at $(( $(date +%s) - T0 )) s"
for f in check_b $(cd $OUTDIR && ls time_*.log | sed 's/.log$//'); do
    echo "--- $f"; sed -n '/^shape /,/^$/p' $OUTDIR/$f.log | grep -v "^$" | head -7
done
