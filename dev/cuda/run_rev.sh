#!/bin/bash
# dev/cuda/run_rev.sh: bwd_rev90's dev run on the device (from the repository root, carry
# [".devbin_bwd"]: check_bwd binaries built here, xz-compressed; check_bwd_a = the baseline).
#   FQ_FULL=x   check_bwd_x's full check first, with bwd_rev90 forced
#               (FLASHQLA_CUDA_BWD_REVERSE=1: every case, context parallelism included)
#   then        the timings of every carried check_bwd_* that is not traced, and the per-role
#               trace digest (dev/cuda/trace_rev.py) of every traced one (check_bwd_t*, built
#               with -DFQ_REV_TRACE) at `one 8 4096 16 32`
#   FQ_NCU=x    Nsight Compute's source counters (warp-state samples per SASS instruction) of
#               bwd_rev90 in check_bwd_x (default k) `one 8 4096 16 32` -> $OUT/rev_sass.csv.xz
#               and the details page; FQ_NONCU=1 leaves ncu out
#   FQ_SAN=1    with FQ_FULL: compute-sanitizer memcheck + racecheck of its small cases (bwd_rev90 forced), last
# Map the SASS samples to source lines here with nvdisasm -g of the same binary's cubin.
set -u
OUTDIR=${OUT:-/tmp/out}; mkdir -p "$OUTDIR"
cd "$(dirname "$0")/../.." || exit 1
. dev/cuda/devrun_lib.sh
BIN=/tmp/fq_rev_bin
fq_unpack_bins .devbin_bwd $BIN
export OMP_NUM_THREADS=$(nproc)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
T0=$(date +%s)
if [ -n "${FQ_FULL:-}" ]; then
    echo "=== $FQ_FULL full"
    FLASHQLA_CUDA_BWD_REVERSE=1 timeout 150 $BIN/check_bwd_$FQ_FULL > $OUTDIR/full_$FQ_FULL.log 2>&1; echo "(exit $? at $(( $(date +%s) - T0 )) s)"
    grep -E "FAIL|error" $OUTDIR/full_$FQ_FULL.log | head -20; grep -E "ALL OK|failures" $OUTDIR/full_$FQ_FULL.log | tail -2
fi
for x in $(ls $BIN | grep -E '^check_bwd_' | grep -v '^check_bwd_t'); do
    echo "=== ${x#check_bwd_}: timings"
    timeout 90 $BIN/$x time > $OUTDIR/time_${x#check_bwd_}.log 2>&1; echo "(exit $? at $(( $(date +%s) - T0 )) s)"
done
for x in $(ls $BIN | grep -E '^check_bwd_t'); do
    echo "=== $x: trace"
    timeout 60 $BIN/$x one 8 4096 16 32 > $OUTDIR/$x.trace 2>&1
    python3 dev/cuda/trace_rev.py < $OUTDIR/$x.trace
done
if [ -z "${FQ_NONCU:-}" ]; then
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
echo "=== ncu ($NCU) of check_bwd_${FQ_NCU:-k}"
timeout 240 $NCU --clock-control none -k regex:fq_bwd_rev90 --launch-count 1 --section SpeedOfLight \
    --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters \
    --import-source no -f -o /tmp/ncu_rev $BIN/check_bwd_${FQ_NCU:-k} one 8 4096 16 32 > $OUTDIR/ncu.log 2>&1
echo "(ncu exit $? at $(( $(date +%s) - T0 )) s)"; tail -3 $OUTDIR/ncu.log
$NCU --import /tmp/ncu_rev.ncu-rep --page details --csv > $OUTDIR/rev_details.csv 2>&1
$NCU --import /tmp/ncu_rev.ncu-rep --page source --csv --print-source sass 2>&1 | xz -6 > $OUTDIR/rev_sass.csv.xz
ls -la $OUTDIR
grep -E "Duration|Warp Cycles Per Issued|Issue Slots Busy|No Eligible|Active Warps Per" $OUTDIR/rev_details.csv | head -12
fi
if [ -n "${FQ_SAN:-}" ] && [ -n "${FQ_FULL:-}" ]; then
    echo "=== $FQ_FULL memcheck and racecheck, small, bwd_rev90 forced"
    # (before session 23 this ran without FLASHQLA_CUDA_BWD_REVERSE=1: the small cases took
    # bwd_state90 + bwd_wy90 by the shape rule, so bwd_rev90 itself was never sanitized)
    FLASHQLA_CUDA_BWD_REVERSE=1 fq_sanitize_pair "$OUTDIR/san" 100 $BIN/check_bwd_$FQ_FULL small small
fi
echo "=== per row (ms): total rec loc st wy at $(( $(date +%s) - T0 )) s"
for f in $(cd $OUTDIR && ls time_*.log | sed 's/.log$//'); do
    echo "--- $f"; sed -n '/^shape /,/^$/p' $OUTDIR/$f.log | grep -v "^$" | head -7
done
