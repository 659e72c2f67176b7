#!/bin/bash
# dev/cuda/run_ab_bwd.sh: A/B of two source trees' CUDA backward in one device call
# (dev/cuda/check_bwd.cu of each tree against its own library kernels). A is the
# baseline tree (e.g. a worktree at the last commit), B this tree; both binaries
# are built here, on the development machine, and carried:
#
#   here:    bash dev/cuda/run_ab_bwd.sh build /work/wt_base      -> .devbin_bwd/check_bwd_{a,b}.xz
#   device:  bash dev/cuda/run_ab_bwd.sh run                       (carry [".devbin_bwd"])
#
# run: B's full check (every correctness case against the float64 reference, then
# the ANCHORS.md backward rows timed), A's timings, B's timings again (drift shows as
# B vs B), B's small cases with FLASHQLA_CUDA_BWD_SM90=0 (the mma.sync kernels and
# bwd_state on Hopper), compute-sanitizer memcheck and racecheck of B on the small
# cases; a table of the per-row times of A and B last. Logs in $OUT. FQ_AB_NO_SAN=1
# leaves the sanitizers out. Further binaries .devbin_bwd/check_bwd_[c-z].xz (variants
# built by hand, e.g. with a diagnostic patch) are timed too. FQ_AB_REV=1: B's full check
# again with bwd_rev90 forced (FLASHQLA_CUDA_BWD_REVERSE=1: the shape rule gives the small
# cases bwd_state90 + bwd_wy90); FQ_AB_REV_SAN=1 its sanitizers too. FQ_AB_ENV="VAR=value
# ...": B's timings once more under that environment (e.g. a switch's off position), as
# "B env". FQ_AB_NO_DRIFT=1 leaves out B's second timing run. FQ_AB_MARK=FILE: FILE is
# touched once every timing has run (what follows does not need the GPU to itself; see
# run_ab_beside_build.sh, which starts the GPU suite then).
set -u
MODE=${1:-run}
OUTDIR=${OUT:-/tmp/out}; mkdir -p "$OUTDIR"
cd "$(dirname "$0")/../.." || exit 1
BIN=$PWD/.devbin_bwd
if [ "$MODE" = build ]; then
    OTHER=${2:?usage: run_ab_bwd.sh build BASELINE_TREE}
    rm -rf "$BIN"; mkdir -p "$BIN"
    bash dev/cuda/build_check_bwd.sh a "" "$OTHER" && bash dev/cuda/build_check_bwd.sh b || exit 1
    ls -la "$BIN"
    exit 0
fi
. dev/cuda/devrun_lib.sh # (after the cd to the repository root)
RUNBIN=/tmp/fq_ab_bwd_bin
fq_unpack_bins "$BIN" $RUNBIN
BIN=$RUNBIN
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
T0=$(date +%s)
echo "=== B: full check + timings"
OMP_NUM_THREADS=$(nproc) timeout 150 $BIN/check_bwd_b > $OUTDIR/check_b.log 2>&1; echo "(exit $? at $(( $(date +%s) - T0 )) s)"
grep -E "FAIL|error|capture" $OUTDIR/check_b.log | head -20
sed -n '/==== summary/,$p' $OUTDIR/check_b.log | head -24
echo "=== A: timings"
OMP_NUM_THREADS=$(nproc) timeout 90 $BIN/check_bwd_a time > $OUTDIR/time_a.log 2>&1; echo "(exit $? at $(( $(date +%s) - T0 )) s)"
if [ -z "${FQ_AB_NO_DRIFT:-}" ]; then
    echo "=== B: timings again"
    OMP_NUM_THREADS=$(nproc) timeout 90 $BIN/check_bwd_b time > $OUTDIR/time_b2.log 2>&1; echo "(exit $? at $(( $(date +%s) - T0 )) s)"
fi
for x in $(ls $BIN | grep -E '^check_bwd_[c-z]$'); do # (extra variants, built by hand: timings only)
    echo "=== ${x#check_bwd_}: timings"
    OMP_NUM_THREADS=$(nproc) timeout 90 $BIN/$x time > $OUTDIR/time_${x#check_bwd_}.log 2>&1; echo "(exit $? at $(( $(date +%s) - T0 )) s)"
done
if [ -n "${FQ_AB_ENV:-}" ]; then
    echo "=== B timings with $FQ_AB_ENV"
    env $FQ_AB_ENV OMP_NUM_THREADS=$(nproc) timeout 90 $BIN/check_bwd_b time > $OUTDIR/time_benv.log 2>&1; echo "(exit $? at $(( $(date +%s) - T0 )) s)"
fi
[ -n "${FQ_AB_MARK:-}" ] && touch "$FQ_AB_MARK"
if [ -n "${FQ_AB_REV:-}" ]; then
    echo "=== B: full check with bwd_rev90 forced"
    FLASHQLA_CUDA_BWD_REVERSE=1 OMP_NUM_THREADS=$(nproc) timeout 150 $BIN/check_bwd_b > $OUTDIR/check_brev.log 2>&1; echo "(exit $? at $(( $(date +%s) - T0 )) s)"
    grep -E "FAIL|error|capture" $OUTDIR/check_brev.log | head -20
    grep -E "ALL OK|failures" $OUTDIR/check_brev.log | tail -2
fi
echo "--- B small, FLASHQLA_CUDA_BWD_SM90=0 (the mma.sync kernels and bwd_state, as off sm_90a)"
FLASHQLA_CUDA_BWD_SM90=0 OMP_NUM_THREADS=$(nproc) timeout 60 $BIN/check_bwd_b small 2>&1 | tail -8
if [ -z "${FQ_AB_NO_SAN:-}" ]; then
    echo "=== B memcheck and racecheck, small (in parallel)"
    if [ -n "${FQ_AB_REV_SAN:-}" ]; then # (the four at once)
        FLASHQLA_CUDA_BWD_REVERSE=1 fq_sanitize_pair "$OUTDIR/bwd_brev" 90 $BIN/check_bwd_b small small > $OUTDIR/san_rev.txt &
    fi
    fq_sanitize_pair "$OUTDIR/bwd_b" 90 $BIN/check_bwd_b small small
    if [ -n "${FQ_AB_REV_SAN:-}" ]; then
        wait
        echo "=== B memcheck and racecheck, small, bwd_rev90 forced"
        cat $OUTDIR/san_rev.txt
    fi
fi
echo "=== per row (ms): total rec loc st wy  (A, B, B again) at $(( $(date +%s) - T0 )) s"
for f in time_a check_b $([ -z "${FQ_AB_NO_DRIFT:-}" ] && echo time_b2) $([ -n "${FQ_AB_ENV:-}" ] && echo time_benv) $(cd $OUTDIR && ls time_[c-z].log 2>/dev/null | sed 's/.log$//'); do
    echo "--- $f"; sed -n '/^shape /,/^$/p' $OUTDIR/$f.log | grep -v "^$" | head -8
done
